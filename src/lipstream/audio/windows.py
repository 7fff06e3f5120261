"""Per-video-frame audio windows with MuseTalk's semantics, built with one gather on the device.

A frame's window is 10 feature steps (200 ms at 50 Hz, flattened with the 5 hidden states to
[50, 384]) centred on the frame. At 25 fps, MuseTalk's native (and default) rate, frame i reads
feature steps 2i-4 .. 2i+5, i.e. video frames i-2 .. i+2: the feature sequence is padded with
LEFT_PAD_STEPS = 2 frames x 2 steps = 4 zero steps on the left, and frame i at fps F reads the 10
padded steps starting at floor(i * 50 / F). Feature step k covers [k / 50, (k + 1) / 50) s, so the
window covers [(s - 4) / 50, (s + 6) / 50) with s = floor(i * 50 / F); its centre (s + 1) / 50 lies
within one feature step (20 ms) of the frame's centre (i + 0.5) / F at 24 fps and every rate above.

The left pad is 4 steps at every rate. Upstream (musetalk/utils/audio_processor.py,
get_whisper_chunk, commit 0a89dec) pads with 2 * ceil(50 / int(fps)) steps instead:
- at 25, 29.97 (int 29) and 30 fps that is 4 as well: at 25 and 30 fps our windows equal
  upstream's bit for bit, at 29.97 they equal upstream's rule at the exact rate (see below);
- at 24 fps it is 6, so upstream's windows sit 2 steps (40 ms) early; ours are centred;
- at 50 and 60 fps it is 2, so upstream's windows sit 2 steps (40 ms) late; ours are centred.
The zeros on the right go as far as the last window needs. Upstream pads 6 * ceil(50 / int(fps))
steps there, which changes no window's content where it suffices (25, 29.97, 30 fps and 24 fps);
at 50 fps (always) and 60 fps (at most lengths) its last window runs past that pad and upstream
exits with an error, where we read zeros.

Besides the left pad, LipStream deliberately differs from upstream in three ways:
- the frame count covers the whole audio, ceil(duration * F), where upstream takes
  floor(duration * int(F)), dropping the last partial frame (see num_frames);
- the fps is exact (29.97 is 30000/1001), where upstream truncates it to an int: at 29 fps its
  frame 100 reads from step 172 where the audio of that frame is at step 166, and the drift grows
  by about 1 step every 18 frames;
- the feature sequence is cut like upstream's, to floor(n / 320) steps (num_feature_steps), but in
  exact integer arithmetic: upstream's floor(n / 16000 * 50) in floating point gives one step
  fewer at some exact multiples of 320 samples (n = 9280, for one).
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from lipstream.media.rates import as_fps  # noqa: F401 (re-exported: lipstream.audio.as_fps)
from lipstream.models.config import (
    AUDIO_DIM, FEATURE_RATE, HIDDEN_STATES, SAMPLE_RATE, WINDOW_FRAMES_LEFT, WINDOW_STEPS, WINDOW_TOKENS)

MUSETALK_FPS = 25  # the video rate MuseTalk's window layout is defined at
STEPS_PER_MUSETALK_FRAME = FEATURE_RATE // MUSETALK_FPS  # 2 feature steps per 25 fps frame
LEFT_PAD_STEPS = WINDOW_FRAMES_LEFT * STEPS_PER_MUSETALK_FRAME  # 4 zero steps on the left, at every fps
assert FEATURE_RATE % MUSETALK_FPS == 0
assert WINDOW_STEPS == 2 * LEFT_PAD_STEPS + STEPS_PER_MUSETALK_FRAME  # 4 steps, the frame's 2, 4 steps: centred


def num_frames(n_samples: int, fps: float | Fraction, sample_rate: int = SAMPLE_RATE) -> int:
    """Video frames that cover `n_samples` of audio: ceil(duration * fps), computed exactly."""
    fps = as_fps(fps)
    return max(1, math.ceil(Fraction(n_samples) * fps / sample_rate))


def padding(frames: int, fps: float | Fraction, steps: int) -> tuple[int, int]:
    """(left, right) zero feature steps around `steps` features so that `frames` windows fit.

    The left pad is LEFT_PAD_STEPS at every rate (see the module docstring); the right pad is what
    the last frame's window needs past the features, at least 0.
    """
    fps = as_fps(fps)
    last_end = (frames - 1) * FEATURE_RATE * fps.denominator // fps.numerator + WINDOW_STEPS  # padded coords
    return LEFT_PAD_STEPS, max(0, last_end - LEFT_PAD_STEPS - steps)


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
    left, right = padding(frames, fps, t)
    starts = window_starts(frames, fps, features.device)
    padded = features.new_zeros(left + t + right, HIDDEN_STATES, AUDIO_DIM)
    padded[left:left + t] = features
    index = starts[:, None] + torch.arange(WINDOW_STEPS, device=features.device)  # [frames, 10]
    return padded[index].reshape(frames, WINDOW_TOKENS, AUDIO_DIM)  # the one gather


def audio_windows_loop(features: torch.Tensor, fps: float | Fraction, frames: int) -> torch.Tensor:
    """The same windows the way upstream builds them: one slice and one cat per frame.

    Kept as the baseline for `lipstream bench` (its "gathered windows off" row) and for tests.
    """
    fps = as_fps(fps)
    left, right = padding(frames, fps, features.shape[0])
    zeros = features.new_zeros(1, HIDDEN_STATES, AUDIO_DIM)
    padded = torch.cat([zeros.repeat(left, 1, 1), features, zeros.repeat(right, 1, 1)])
    clips = []
    for i in range(frames):
        start = math.floor(i * FEATURE_RATE / fps)
        clips.append(padded[start:start + WINDOW_STEPS].reshape(1, WINDOW_TOKENS, AUDIO_DIM))
    return torch.cat(clips)
