"""Text scenes' speech (show/tts.py): espeak-ng for real (Debian's package; `make espeak` installs it),
Piper's errors (no voice file can be fetched here)."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from lipstream.audio.decode import load_mono
from lipstream.errors import InputError, LipStreamError
from lipstream.show.tts import EspeakVoice, PiperVoice, pick_voice, speak

needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None,
                                  reason="espeak-ng is not installed (make espeak)")
SENTENCE = "Markets closed higher today as investors welcomed the central bank decision."  # 11 words


def rms_db(x: np.ndarray) -> float:
    return 20 * np.log10(np.sqrt(np.mean(np.square(x, dtype=np.float64))) + 1e-12)


@needs_espeak
def test_text_scene_is_speech_of_plausible_length(tmp_path):
    voice = pick_voice(None)
    assert voice.name == "espeak-ng en"
    path = speak(SENTENCE, voice, tmp_path / "scene0.wav")
    assert path == tmp_path / "scene0.wav" and sorted(os.listdir(tmp_path)) == ["scene0.wav"]  # no tmp left
    samples, rate = load_mono(path)  # the render's own loader reads it like any audio scene
    seconds = samples.numel() / rate
    assert 2.0 < seconds < 7.0, seconds  # ~150-175 words a minute
    assert rms_db(samples.numpy()) > -30
    # speech, not a tone: it has pauses between words (20 ms windows well below the loud ones)
    windows = samples.numpy()[: samples.numel() // 441 * 441].reshape(-1, 441)
    levels = 10 * np.log10(np.mean(windows.astype(np.float64) ** 2, axis=1) + 1e-12)
    assert np.percentile(levels, 95) - np.percentile(levels, 10) > 20
    # longer text, longer speech
    short, rate_short = voice.speak("Good evening.")
    long, rate_long = voice.speak(" ".join([SENTENCE] * 3))
    assert short.size / rate_short < 1.5 < seconds < long.size / rate_long
    assert long.size / rate_long > 2.5 * seconds


@needs_espeak
def test_named_espeak_voices():
    assert pick_voice("de").name == "espeak-ng de"
    assert pick_voice("en-us+f3").name == "espeak-ng en-us+f3"
    samples, rate = EspeakVoice("English (America)").speak("Hello there.")
    assert samples.dtype == np.float32 and rate > 8000 and rms_db(samples) > -30


@needs_espeak
def test_unknown_espeak_voice_is_one_line_with_close_names():
    with pytest.raises(LipStreamError) as e:
        pick_voice("en-uss")
    message = str(e.value)
    assert "en-uss" in message and "en-us" in message.split("mean", 1)[1] and "\n" not in message
    with pytest.raises(LipStreamError, match=r"variant 'f9'.*mean f\d"):
        pick_voice("en+f9")


def test_missing_espeak_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine without the binary
    with pytest.raises(LipStreamError) as e:
        pick_voice(None)
    assert "apt-get install espeak-ng" in str(e.value) and "make espeak" in str(e.value)


def test_missing_piper_voice_file(tmp_path):
    with pytest.raises(InputError) as e:
        pick_voice(str(tmp_path / "en_US-lessac-medium.onnx"))
    assert "en_US-lessac-medium.onnx" in str(e.value) and "no such Piper voice file" in str(e.value)
    (tmp_path / "v.onnx").write_bytes(b"\0" * 16)
    with pytest.raises(InputError, match=r"v\.onnx\.json"):
        PiperVoice(tmp_path / "v.onnx")


@pytest.mark.skipif(importlib.util.find_spec("piper") is not None, reason="piper-tts is installed here")
def test_piper_not_installed_says_what_to_install(tmp_path):
    model = tmp_path / "v.onnx"
    model.write_bytes(b"\0" * 16)
    Path(f"{model}.json").write_text("{}")
    with pytest.raises(LipStreamError) as e:
        pick_voice(str(model))
    assert "pip install piper-tts" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.skipif(not os.environ.get("LIPSTREAM_PIPER_VOICE") or importlib.util.find_spec("piper") is None,
                    reason="a real Piper run needs piper-tts and a voice file in LIPSTREAM_PIPER_VOICE "
                           "(none can be downloaded here)")
def test_piper_speaks(tmp_path):
    voice = pick_voice(os.environ["LIPSTREAM_PIPER_VOICE"])
    samples, rate = load_mono(speak(SENTENCE, voice, tmp_path / "p.wav"))
    assert voice.name.startswith("piper ") and 2.0 < samples.numel() / rate < 8.0
