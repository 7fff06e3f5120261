"""The newsroom show around the presenters: titles, ticker, logo, picture-in-picture and cutaways
(composited on the device, in the render's own pass), music ducked under the speech, text spoken by a TTS.

spec.py: what a broadcast script asks for (dataclasses, no I/O). schema.py: the script's keys -> spec,
with the one-line errors. text.py: strings -> RGBA sprites (Pillow). sources.py: stills and videos for
pip/cutaway, decoded as the render goes. compose.py: the layers painted into I420 batches on the device.
mix.py: music under speech with side-chain ducking. tts.py: text -> speech (espeak-ng, Piper).
"""
