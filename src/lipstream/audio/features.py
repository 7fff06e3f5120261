"""Whisper-tiny encoder features for audio of any length: [T, 5, 384] at 50 Hz, on the device.

The audio is cut into 30 s segments (zero-padded, as Whisper's feature extractor does), the
log-mel spectrogram of all segments is computed in one batched STFT on the device, and all
segments go through the encoder in one batched call. All 5 hidden states (embedding output and
4 layers) are kept, as MuseTalk uses them.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Protocol

import numpy as np
import torch

from lipstream.models.config import (
    AUDIO_DIM, HIDDEN_STATES, HOP_LENGTH, MEL_FRAMES, N_FFT, SAMPLES_PER_FEATURE, SEGMENT_SAMPLES)

MAX_SEGMENTS_PER_CALL = 64  # 32 minutes of audio per encoder call bounds activation memory


class AudioNetworks(Protocol):
    """What the features need of a model set: the networks' modules (models.MuseTalk) and the compiled
    packages (engine.aot.CompiledNetworks) both have it."""

    device: torch.device
    dtype: torch.dtype

    @property
    def mel_filters(self) -> np.ndarray:
        """Whisper's mel filter bank, [201, 80] (WhisperFeatureExtractor.mel_filters)."""

    def whisper_states(self, mel: torch.Tensor) -> torch.Tensor:
        """[S, 80, 3000] log-mel in the networks' dtype -> [S, 1500, 5, 384]: every hidden state of the
        Whisper encoder (the embeddings and each layer's output), stacked."""


@lru_cache(maxsize=8)
def _window_and_filters(device: torch.device, filters_key: bytes) -> tuple[torch.Tensor, torch.Tensor]:
    filters = np.frombuffer(filters_key, dtype=np.float64).reshape(N_FFT // 2 + 1, -1)
    return (torch.hann_window(N_FFT, device=device),
            torch.from_numpy(filters.T.copy()).to(device=device, dtype=torch.float32))


def num_segments(n_samples: int) -> int:
    return max(1, math.ceil(n_samples / SEGMENT_SAMPLES))


def num_feature_steps(n_samples: int) -> int:
    """Encoder steps kept: floor(n / 320), one per whole 20 ms of audio, at least 1.

    Upstream (get_whisper_chunk) trims to floor(n / 16000 * 50) steps the same way: the partial
    last step and the segment's zero padding are dropped, so a window reaching past them reads
    zeros, exactly as upstream's does. (Upstream computes it in floating point, which at some exact
    multiples of 320 samples, n = 9280 for one, gives one step fewer; this is the exact value.)
    """
    return max(1, n_samples // SAMPLES_PER_FEATURE)


def log_mel_segments(audio: torch.Tensor, mel_filters: np.ndarray) -> torch.Tensor:
    """[n] samples at 16 kHz -> [S, 80, 3000] log-mel, the same maths as WhisperFeatureExtractor per segment."""
    s = num_segments(audio.numel())
    padded = torch.zeros(s * SEGMENT_SAMPLES, device=audio.device, dtype=torch.float32)
    padded[: audio.numel()] = audio
    window, filters = _window_and_filters(audio.device, mel_filters.astype(np.float64).tobytes())
    stft = torch.stft(padded.view(s, SEGMENT_SAMPLES), N_FFT, HOP_LENGTH, window=window, return_complex=True)
    power = stft[..., :MEL_FRAMES].abs().square()  # drop the last frame, as Whisper does
    mel = torch.clamp(filters @ power, min=1e-10).log10()  # [S, 80, 3000]
    peak = mel.amax(dim=(1, 2), keepdim=True)
    return (torch.maximum(mel, peak - 8.0) + 4.0) / 4.0


@torch.inference_mode()
def encode_segments(mel: torch.Tensor, networks: AudioNetworks) -> torch.Tensor:
    """[S, 80, 3000] -> [S * 1500, 5, 384]: every hidden state of every segment, in time order."""
    out = [networks.whisper_states(mel[start:start + MAX_SEGMENTS_PER_CALL].to(networks.dtype))
           for start in range(0, mel.shape[0], MAX_SEGMENTS_PER_CALL)]  # [s, 1500, 5, 384] each
    states = torch.cat(out) if len(out) > 1 else out[0]
    assert states.shape[2:] == (HIDDEN_STATES, AUDIO_DIM), states.shape
    return states.reshape(-1, HIDDEN_STATES, AUDIO_DIM)


@torch.inference_mode()
def whisper_features(audio: torch.Tensor | np.ndarray, networks: AudioNetworks) -> torch.Tensor:
    """16 kHz mono samples -> [T, 5, 384] features on the networks' device, T = num_feature_steps(n).

    T = max(1, floor(n / 320)), as upstream: the partial last step and the steps past the end of
    the audio (the zero padding of the last segment) are dropped.
    """
    if isinstance(audio, np.ndarray):
        audio = torch.from_numpy(audio)
    audio = audio.to(device=networks.device, dtype=torch.float32, non_blocking=True)
    if audio.ndim != 1 or audio.numel() == 0:
        raise ValueError(f"expected a non-empty 1-D array of samples, got shape {tuple(audio.shape)}")
    states = encode_segments(log_mel_segments(audio, networks.mel_filters), networks)
    return states[: num_feature_steps(audio.numel())]
