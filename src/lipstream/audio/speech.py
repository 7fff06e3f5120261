"""One call from an audio file to the per-frame windows the UNet consumes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from lipstream.audio.decode import load_audio_tensor
from lipstream.audio.features import AudioNetworks, whisper_features
from lipstream.audio.windows import as_fps, audio_windows, num_frames
from lipstream.models.config import SAMPLE_RATE


@dataclass
class Speech:
    """Decoded speech and its features, aligned to a video frame rate."""

    samples: torch.Tensor  # [n] float32, 16 kHz mono, on the encoder's device
    fps: Fraction
    features: torch.Tensor  # [T, 5, 384], T = max(1, floor(n / 320)), as upstream
    windows: torch.Tensor  # [frames, 50, 384], no positional encoding
    timings_ms: dict[str, float] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.samples.numel() / SAMPLE_RATE

    @property
    def frames(self) -> int:
        return self.windows.shape[0]


def prepare_speech(audio: str | Path | np.ndarray | torch.Tensor, fps: float | Fraction,
                   networks: AudioNetworks) -> Speech:
    """Decode (if given a path), extract Whisper features and gather per-frame windows, on the networks' device.

    Arrays and tensors are taken as 16 kHz mono samples.
    """
    fps = as_fps(fps)
    device = networks.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    if isinstance(audio, (str, Path)):
        samples = load_audio_tensor(audio, device)
    else:
        samples = torch.as_tensor(audio, dtype=torch.float32).to(device)
    sync()
    t1 = time.perf_counter()
    features = whisper_features(samples, networks)
    sync()
    t2 = time.perf_counter()
    windows = audio_windows(features, fps, num_frames(samples.numel(), fps))
    sync()
    t3 = time.perf_counter()
    timings = {"decode": (t1 - t0) * 1e3, "features": (t2 - t1) * 1e3, "windows": (t3 - t2) * 1e3,
               "total": (t3 - t0) * 1e3}
    return Speech(samples, fps, features, windows, timings)
