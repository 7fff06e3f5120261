"""Per-frame audio windows: centred on the frame at every rate, bit-exact with upstream where upstream is.

Upstream's rule is re-written here from MuseTalk v1.5 (musetalk/utils/audio_processor.py,
get_whisper_chunk, commit 0a89dec): fps = int(fps), multiplier = 50 / fps, trim the features to
floor(n / 16000 * 50) steps, pad 2 * ceil(multiplier) zero steps on the left and 6 * ceil(multiplier)
on the right, and give frame i (of floor(n / 16000 * fps)) the 10 steps from floor(i * multiplier).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from lipstream.audio.features import num_feature_steps, whisper_features
from lipstream.audio.windows import (
    LEFT_PAD_STEPS, as_fps, audio_windows, audio_windows_loop, num_frames, padding, window_starts)

ALL_FPS = [24, 25, 29.97, 30, 50, 60]
SECONDS = [1.0, 7.37, 12.345, 31.37]  # n = 16000, 117920, 197520, 501920 samples: whole and partial last steps


def upstream_chunk(full: torch.Tensor, n: int, fps, exact: bool = False):
    """get_whisper_chunk's indexing on `full`, the encoder output of every 30 s segment [S * 1500, 5, 384].

    exact=True evaluates the same rule at the exact rate (29.97 -> 30000/1001) instead of int(fps).
    Returns (windows, the padded sequence, the left pad, the window starts, complete). Upstream
    exits with an error at the first window that runs past its right pad (at 50 fps the last frame
    always does); then `windows` holds the frames before it and `complete` is False.
    """
    if exact:
        fps = as_fps(fps)
        multiplier = Fraction(50) / fps
        frames = math.floor(Fraction(n, 16000) * fps)
    else:
        fps = int(fps)
        multiplier = 50 / fps
        frames = math.floor((n / 16000) * fps)
    kept = full[: math.floor((n / 16000) * 50)]
    pad = math.ceil(multiplier)
    padded = torch.cat([torch.zeros_like(kept[: pad * 2]), kept, torch.zeros_like(kept[: pad * 3 * 2])])
    starts, clips = [], []
    for i in range(frames):
        start = math.floor(i * multiplier)
        clip = padded[start:start + 10]
        if clip.shape[0] != 10:  # upstream prints the shapes and calls exit()
            return torch.stack(clips), padded, pad * 2, starts, False
        starts.append(start)
        clips.append(clip.reshape(50, 384))
    return torch.stack(clips), padded, pad * 2, starts, True


def segment_features(n: int, seed: int) -> torch.Tensor:
    """Random stand-ins for the encoder output of all 30 s segments of n samples, padding included."""
    steps = math.ceil(n / 480_000) * 1500
    return torch.randn(steps, 5, 384, generator=torch.Generator().manual_seed(seed))


def ours(full: torch.Tensor, n: int, fps) -> torch.Tensor:
    """LipStream's windows for the same audio: whisper_features keeps num_feature_steps(n) steps."""
    return audio_windows(full[: num_feature_steps(n)], fps, num_frames(n, fps))


def step_features(t: int) -> torch.Tensor:
    """[t, 5, 384] whose value at [k, 0, 0] is k + 1, so a window says which steps it read (0 = padding)."""
    f = torch.zeros(t, 5, 384)
    f[:, 0, 0] = torch.arange(1, t + 1, dtype=torch.float32)
    return f


def steps_read(windows: torch.Tensor) -> torch.Tensor:
    """[frames, 50, 384] windows of step_features -> [frames, 10] feature steps read (-1 = padding)."""
    return windows.reshape(windows.shape[0], 10, 5, 384)[:, :, 0, 0].long() - 1


def samples(seconds: float) -> int:
    n = round(seconds * 16000)
    assert math.floor((n / 16000) * 50) == n // 320  # upstream's float trim is exact at these lengths
    return n


@pytest.mark.parametrize("seconds", SECONDS)
@pytest.mark.parametrize("fps", [25, 30])
def test_bit_exact_with_upstream_at_25_and_30(seconds, fps):
    n = samples(seconds)
    full = segment_features(n, seed=int(seconds * 1000))
    want, *_, complete = upstream_chunk(full, n, fps)
    assert complete
    got = ours(full, n, fps)
    assert got.shape[0] == num_frames(n, fps) >= want.shape[0]  # we also cover the last partial frame
    assert torch.equal(got[: want.shape[0]], want)


@pytest.mark.parametrize("seconds", SECONDS)
@pytest.mark.parametrize("fps, shift", [(24, 2), (50, -2), (60, -2)])
def test_upstream_shifted_where_upstream_is_off_centre(seconds, fps, shift):
    """At 24 fps upstream pads 6 steps (its windows are 2 steps early), at 50 / 60 fps 2 (2 steps late).

    At 50 fps (and at 60 fps for most lengths) upstream's last window runs past its 6 steps of right
    padding and it exits; LipStream pads with zeros as far as the windows need.
    """
    n = samples(seconds)
    full = segment_features(n, seed=int(seconds * 1000) + fps)
    want, padded, left, starts, complete = upstream_chunk(full, n, fps)
    assert left - LEFT_PAD_STEPS == shift
    if fps == 24:
        assert complete
    if fps == 50:
        assert not complete  # upstream exits on the last frame
    got = ours(full, n, fps)
    assert got.shape[0] >= want.shape[0]
    assert not torch.equal(got[: want.shape[0]], want)  # the difference is real
    ext = torch.cat([torch.zeros(2, 5, 384), padded])  # more zeros on the left, for frames 0-1 at 50 / 60 fps
    for i, s in enumerate(starts):
        assert torch.equal(got[i], ext[s + 2 + shift:s + 12 + shift].reshape(50, 384)), i


@pytest.mark.parametrize("seconds", SECONDS)
def test_29_97_is_upstreams_rule_at_the_exact_rate(seconds):
    n = samples(seconds)
    full = segment_features(n, seed=int(seconds * 1000) + 2997)
    want, *_, complete = upstream_chunk(full, n, 29.97, exact=True)
    assert complete
    got = ours(full, n, 29.97)
    assert got.shape[0] >= want.shape[0]
    assert torch.equal(got[: want.shape[0]], want)
    truncated, _, left, starts, complete = upstream_chunk(full, n, 29.97)  # upstream itself: int(29.97) = 29
    assert complete
    assert left == LEFT_PAD_STEPS  # same pad; only the rate differs
    if len(starts) > 100:
        assert starts[100] == 172 and window_starts(101, 29.97)[100].item() == 166  # upstream drifts late
    assert not torch.equal(got[: truncated.shape[0]], truncated)


@pytest.mark.parametrize("fps", ALL_FPS)
def test_window_centred_on_frame_time(fps):
    """Step k covers [k / 50, (k + 1) / 50) s; frame i's window of steps s .. s + 9 is centred at (s + 5) / 50,
    within one feature step (20 ms) of the frame's centre (i + 0.5) / fps."""
    rate = as_fps(fps)
    frames = 1500
    t = math.ceil(frames * 50 / rate) + 20
    read = steps_read(audio_windows(step_features(t), rate, frames))
    for i in range(frames):
        j = int(torch.nonzero(read[i] >= 0)[0])
        first = int(read[i, j]) - j  # the window's first step, padding included
        assert read[i].tolist() == [k if 0 <= k < t else -1 for k in range(first, first + 10)]
        error = Fraction(first + 5, 50) - (i + Fraction(1, 2)) / rate
        assert abs(error) <= Fraction(1, 50), (i, float(error))
        if rate == 25:
            assert error == 0  # MuseTalk's layout: frames i-2 .. i+2 exactly


def centre_errors(left_pad: int, fps, frames: int = 1500) -> list[Fraction]:
    """Centre error of a rule with `left_pad` zero steps and starts floor(i * 50 / fps) (exact fps)."""
    rate = as_fps(fps)
    starts = window_starts(frames, rate).tolist()
    return [Fraction(s - left_pad + 5, 50) - (i + Fraction(1, 2)) / rate for i, s in enumerate(starts)]


def test_old_and_upstream_rules_are_off_centre():
    """The centring test above fails for the previous rule (2 * floor(50 / fps)) at 30 fps, and for
    upstream's own (2 * ceil(50 / int(fps))) at 24, 50 and 60 fps."""
    late = Fraction(1, 50)
    assert all(e > late for e in centre_errors(2 * math.floor(50 / 30), 30))  # 24 .. 44 ms late
    assert all(e > late for e in centre_errors(2 * math.floor(50 / 60), 60))  # 0 steps: 71 .. 91 ms late
    assert all(e < -late for e in centre_errors(2 * math.ceil(50 / 24), 24))  # upstream: 40 ms early
    for fps in (50, 60):
        assert all(e > late for e in centre_errors(2 * math.ceil(50 / fps), fps))  # upstream: 40 ms late
    for fps in ALL_FPS:
        assert all(abs(e) <= late for e in centre_errors(LEFT_PAD_STEPS, fps))


def test_30fps_frame_10_reads_steps_12_to_21():
    """t = 10 / 30 s = step 16.7: the window is steps 12 .. 21 (the previous rule read 14 .. 23)."""
    read = steps_read(audio_windows(step_features(100), 30, 40))
    assert read[10].tolist() == list(range(12, 22))
    assert read[0].tolist() == [-1] * 4 + list(range(6))  # 4 zero steps of left padding at 30 fps too


def test_window_content_at_25fps():
    """At 25 fps frame i sees feature steps 2i-4 .. 2i+5 (frames i-2 .. i+2)."""
    read = steps_read(audio_windows(step_features(100), 25, 50))
    assert read[10].tolist() == list(range(16, 26))
    assert read[0].tolist() == [-1, -1, -1, -1, 0, 1, 2, 3, 4, 5]
    assert read[49].tolist() == [94, 95, 96, 97, 98, 99, -1, -1, -1, -1]


def test_feature_steps_are_floored_like_upstream():
    for n in (1600, 16000, 16319, 117920, 197520, 501920):
        assert num_feature_steps(n) == math.floor((n / 16000) * 50) == n // 320
    # upstream's float expression drops one more step at some exact multiples of 320; we keep the exact count
    assert math.floor((9280 / 16000) * 50) == 28 and num_feature_steps(9280) == 29 == 9280 // 320
    assert num_feature_steps(100) == 1  # never empty


def centred_loop(features: torch.Tensor, fps, frames: int) -> torch.Tensor:
    """The rule written out: 4 zero steps on the left, zeros that never run out on the right, a slice per frame."""
    rate = as_fps(fps)
    zeros = torch.zeros(1, 5, 384, dtype=features.dtype)
    padded = torch.cat([zeros.repeat(4, 1, 1), features, zeros.repeat(math.ceil(frames * 50 / rate) + 20, 1, 1)])
    return torch.stack([padded[s:s + 10].reshape(50, 384)
                        for s in (math.floor(i * 50 / rate) for i in range(frames))])


@pytest.fixture(scope="module", params=[0.1, *(pytest.param(s, marks=pytest.mark.slow) for s in (7.0, 30.0, 61.0))],
                ids=lambda d: f"{d}s")
def speech(request, tiny_models):
    seconds = request.param
    n = int(round(seconds * 16000))
    audio = np.random.default_rng(int(seconds * 10)).standard_normal(n).astype(np.float32) * 0.1
    return n, whisper_features(audio, tiny_models)


@pytest.mark.parametrize("fps", [25, 30, 29.97])
def test_gather_equals_loop(speech, fps):
    n, features = speech
    assert features.shape == (num_feature_steps(n), 5, 384)
    frames = num_frames(n, fps)
    got = audio_windows(features, fps, frames)
    assert got.shape == (frames, 50, 384)
    assert torch.equal(got, centred_loop(features, fps, frames))


@pytest.mark.parametrize("seconds", [0.1, 7.0, 7.37, 30.0, 61.0])
@pytest.mark.parametrize("fps", ALL_FPS)
def test_frame_count_covers_the_audio(seconds, fps):
    n = int(round(seconds * 16000))
    frames = num_frames(n, fps)
    audio = Fraction(n, 16000)
    video = frames / as_fps(fps)
    assert audio <= video < audio + 1 / as_fps(fps)


def test_starts_are_exact_at_ntsc_rates():
    fps = as_fps(29.97)
    assert fps == Fraction(30000, 1001)
    starts = window_starts(100_000, fps).tolist()
    assert starts == [i * 50 * 1001 // 30000 for i in range(100_000)]
    assert LEFT_PAD_STEPS == 4
    for rate in [12.5, *ALL_FPS, 59.94]:
        left, right = padding(300, rate, 100)
        assert left == 4 and left + 100 + right == math.floor(299 * 50 / as_fps(rate)) + 10
    assert padding(10, 25, 1000) == (4, 0)  # the features outlast the windows: no right pad


def test_windows_stay_on_device_and_dtype():
    features = torch.randn(60, 5, 384, dtype=torch.float16)
    w = audio_windows(features, 25)
    assert w.dtype == torch.float16 and w.device == features.device and w.shape == (30, 50, 384)
    with pytest.raises(ValueError, match="expected features"):
        audio_windows(torch.randn(60, 384), 25)


@pytest.mark.parametrize("fps", [23.976, *ALL_FPS, 59.94])
def test_any_fps(fps):
    features = torch.randn(400, 5, 384)
    frames = num_frames(400 * 320, fps)
    assert torch.equal(audio_windows(features, fps, frames), centred_loop(features, fps, frames))


@pytest.mark.parametrize("fps", [12.5, 24, 25, 29.97, 30, 60])
def test_packaged_loop_baseline_equals_gather(fps):
    features = torch.randn(300, 5, 384)
    assert torch.equal(audio_windows_loop(features, fps, 170), audio_windows(features, fps, 170))
