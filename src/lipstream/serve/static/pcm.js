// An audio file as the speech socket takes it: decoded by the browser, one channel, 16 kHz, PCM16.

export const RATE = 16000;

export async function pcm16(bytes) {
  // an OfflineAudioContext decodes and resamples without an audio device (and without a user gesture)
  const decoded = await new OfflineAudioContext(1, 1, RATE).decodeAudioData(bytes);
  const mixer = new OfflineAudioContext(1, decoded.length, RATE);
  const source = mixer.createBufferSource();
  source.buffer = decoded;
  source.connect(mixer.destination); // a one-channel destination: WebAudio mixes the channels down
  source.start();
  const mono = (await mixer.startRendering()).getChannelData(0);
  const out = new Int16Array(mono.length);
  for (let i = 0; i < mono.length; i++) out[i] = Math.max(-1, Math.min(1, mono[i])) * 32767;
  return out;
}
