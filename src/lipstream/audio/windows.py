"""Per-video-frame audio windows with MuseTalk's semantics, built with one gather on the device.

MuseTalk (musetalk/utils/audio_processor.py, get_whisper_chunk) gives frame i at fps F the 10
feature steps starting at floor(i * 50 / F) of the feature sequence padded with
2 * floor(50 / F) zero steps on the left and 6 * floor(50 / F) on the right, flattened with the
5 hidden states to [50, 384]. At 25 fps that is frames i-2 .. i+2. We keep that exactly, with
two deliberate differences, both about length, never about which features a frame sees:
- the frame count covers the whole audio, ceil(duration * F), where upstream drops the last
  partial second (floor(seconds) * F), so the video lasts as long as the speech;
- the fps is exact (29.97 is 30000/1001), where upstream truncates it to an int (29).
The right padding is extended with zeros when a frame's window would run past it, where upstream
would stop with an error.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from lipstream.models.config import (
    AUDIO_DIM, FEATURE_RATE, HIDDEN_STATES, SAMPLE_RATE, WINDOW_FRAMES_LEFT, WINDOW_FRAMES_RIGHT, WINDOW_STEPS,
    WINDOW_TOKENS)

_NTSC = {Fraction(24000, 1001), Fraction(30000, 1001), Fraction(60000, 1001)}


def as_fps(fps: float | int | Fraction | str) -> Fraction:
    """An exact frame rate: 25 -> 25, "30000/1001" -> 30000/1001, 29.97 -> 30000/1001 (NTSC)."""
    value = Fraction(fps) if not isinstance(fps, float) else Fraction(fps).limit_denominator(1_000_000)
    for ntsc in _NTSC:  # 23.976 / 29.97 / 59.94 written as decimals mean the NTSC rates
        if value != ntsc and abs(value - ntsc) < Fraction(1, 200) and (value * 1000).denominator == 1:
            return ntsc
    if value <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    return value


def num_frames(n_samples: int, fps: float | Fraction, sample_rate: int = SAMPLE_RATE) -> int:
    """Video frames that cover `n_samples` of audio: ceil(duration * fps), computed exactly."""
    fps = as_fps(fps)
    return max(1, math.ceil(Fraction(n_samples) * fps / sample_rate))


def padding(fps: float | Fraction) -> tuple[int, int]:
    """(left, right) zero feature steps around the sequence, as upstream: 2x and 6x floor(50 / fps)."""
    per_frame = math.floor(FEATURE_RATE / as_fps(fps))
    return per_frame * WINDOW_FRAMES_LEFT, per_frame * 3 * WINDOW_FRAMES_RIGHT


def window_starts(frames: int, fps: float | Fraction, device: torch.device | str = "cpu") -> torch.Tensor:
    """[frames] int64: floor(i * 50 / fps), exact integer arithmetic on the device."""
    fps = as_fps(fps)
    i = torch.arange(frames, device=device, dtype=torch.int64)
    return torch.div(i * (FEATURE_RATE * fps.denominator), fps.numerator, rounding_mode="floor")


def audio_windows(features: torch.Tensor, fps: float | Fraction, frames: int | None = None) -> torch.Tensor:
    """[T, 5, 384] features -> [frames, 50, 384] windows (no positional encoding), same device and dtype.

    `frames` defaults to the frames covering T feature steps; pass num_frames(n_samples, fps) to
    match the audio's exact length.
    """
    if features.ndim != 3 or features.shape[1:] != (HIDDEN_STATES, AUDIO_DIM):
        raise ValueError(f"expected features [T, {HIDDEN_STATES}, {AUDIO_DIM}], got {tuple(features.shape)}")
    fps = as_fps(fps)
    t = features.shape[0]
    if frames is None:
        frames = max(1, math.ceil(Fraction(t) * fps / FEATURE_RATE))
    left, right = padding(fps)
    starts = window_starts(frames, fps, features.device)
    last_needed = int(math.floor((frames - 1) * FEATURE_RATE / fps)) + WINDOW_STEPS  # exclusive end, padded coords
    right = max(right, last_needed - left - t)
    padded = features.new_zeros(left + t + right, HIDDEN_STATES, AUDIO_DIM)
    padded[left:left + t] = features
    index = starts[:, None] + torch.arange(WINDOW_STEPS, device=features.device)  # [frames, 10]
    return padded[index].reshape(frames, WINDOW_TOKENS, AUDIO_DIM)  # the one gather


def audio_windows_loop(features: torch.Tensor, fps: float | Fraction, frames: int) -> torch.Tensor:
    """The same windows the way upstream builds them: one slice and one cat per frame.

    Kept as the baseline for `lipstream bench` (its "gathered windows off" row) and for tests.
    """
    fps = as_fps(fps)
    left, right = padding(fps)
    right = max(right, math.floor((frames - 1) * FEATURE_RATE / fps) + WINDOW_STEPS - left - features.shape[0])
    zeros = features.new_zeros(1, HIDDEN_STATES, AUDIO_DIM)
    padded = torch.cat([zeros.repeat(left, 1, 1), features, zeros.repeat(right, 1, 1)])
    clips = []
    for i in range(frames):
        start = math.floor(i * FEATURE_RATE / fps)
        clips.append(padded[start:start + WINDOW_STEPS].reshape(1, WINDOW_TOKENS, AUDIO_DIM))
    return torch.cat(clips)
