"""Audio in: decode anything to 16 kHz mono, Whisper features, per-frame windows."""

from lipstream.audio.decode import load_audio
from lipstream.audio.features import whisper_features
from lipstream.audio.speech import Speech, prepare_speech
from lipstream.audio.windows import as_fps, audio_windows, num_frames

__all__ = ["Speech", "prepare_speech", "as_fps", "audio_windows", "load_audio", "num_frames", "whisper_features"]
