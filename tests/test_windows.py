"""Per-frame audio windows: the one-gather implementation against plain loops written here."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from lipstream.audio.features import num_feature_steps, whisper_features
from lipstream.audio.windows import as_fps, audio_windows, num_frames, padding, window_starts

FPS = [25, 30, 29.97]
DURATIONS = [0.1, 7.0, 30.0, 61.0]


def loop_windows(features: torch.Tensor, fps: Fraction, frames: int) -> torch.Tensor:
    """MuseTalk's get_whisper_chunk loop, frame by frame, with zero padding that never runs out."""
    multiplier = Fraction(50) / fps
    pad = math.floor(multiplier)
    zeros = torch.zeros(1, 5, 384, dtype=features.dtype)
    padded = torch.cat([zeros.repeat(pad * 2, 1, 1), features, zeros.repeat(pad * 6 + 20, 1, 1)])
    clips = []
    for i in range(frames):
        start = math.floor(i * multiplier)
        clip = padded[start:start + 10]
        assert clip.shape[0] == 10
        clips.append(clip.reshape(50, 384))
    return torch.stack(clips)


@pytest.fixture(scope="module", params=DURATIONS, ids=[f"{d}s" for d in DURATIONS])
def speech(request, tiny_models):
    seconds = request.param
    n = int(round(seconds * 16000))
    audio = np.random.default_rng(int(seconds * 10)).standard_normal(n).astype(np.float32) * 0.1
    return n, whisper_features(audio, tiny_models.whisper, tiny_models.feature_extractor)


@pytest.mark.parametrize("fps", FPS)
def test_gather_equals_loop(speech, fps):
    n, features = speech
    assert features.shape == (num_feature_steps(n), 5, 384)
    exact = as_fps(fps)
    frames = num_frames(n, exact)
    got = audio_windows(features, exact, frames)
    want = loop_windows(features, exact, frames)
    assert got.shape == (frames, 50, 384)
    assert torch.equal(got, want)


@pytest.mark.parametrize("seconds", DURATIONS)
@pytest.mark.parametrize("fps", FPS)
def test_frame_count_covers_the_audio(seconds, fps):
    n = int(round(seconds * 16000))
    frames = num_frames(n, fps)
    audio = Fraction(n, 16000)
    video = frames / as_fps(fps)
    assert audio <= video < audio + 1 / as_fps(fps)


@pytest.mark.parametrize("fps", [25, 30])
def test_same_windows_as_upstream_where_upstream_has_them(fps):
    """Upstream keeps floor(seconds) of audio; on the frames whose window lies inside that, we agree exactly."""
    seconds = 7.4
    t = math.ceil(seconds * 50)
    features = torch.randn(t, 5, 384)
    # upstream: trim to whole seconds, pad 2x / 6x floor(50 / fps), loop over floor(seconds) * fps frames
    kept = math.floor(seconds) * 50
    mult = 50 / fps
    pad = math.floor(mult)
    trimmed = features[:kept]
    padded = torch.cat([torch.zeros(pad * 2, 5, 384), trimmed, torch.zeros(pad * 6, 5, 384)])
    upstream = []
    for i in range(math.floor(seconds) * fps):
        start = math.floor(i * mult)
        upstream.append(padded[start:start + 10].reshape(50, 384))
    upstream = torch.stack(upstream)
    ours = audio_windows(features, fps, num_frames(int(seconds * 16000), fps))
    assert ours.shape[0] > upstream.shape[0]  # we cover the last partial second too
    inside = [i for i in range(upstream.shape[0]) if math.floor(i * mult) + 10 - pad * 2 <= kept]
    assert len(inside) > upstream.shape[0] - 10
    assert torch.equal(ours[inside], upstream[inside])


def test_window_content_is_centred_on_the_frame():
    """At 25 fps frame i sees feature steps 2i-4 .. 2i+5 (frames i-2 .. i+2)."""
    t = 100
    features = torch.arange(t, dtype=torch.float32)[:, None, None].expand(t, 5, 384).contiguous()
    windows = audio_windows(features, 25, 50).reshape(50, 10, 5, 384)[:, :, 0, 0]
    assert windows[10].tolist() == list(range(16, 26))
    assert windows[0].tolist() == [0, 0, 0, 0, 0, 1, 2, 3, 4, 5]  # 4 zero steps of left padding, then step 0..
    assert windows[49].tolist() == [94, 95, 96, 97, 98, 99, 0, 0, 0, 0]


def test_starts_are_exact_at_ntsc_rates():
    fps = as_fps(29.97)
    assert fps == Fraction(30000, 1001)
    starts = window_starts(100_000, fps).tolist()
    assert starts == [i * 50 * 1001 // 30000 for i in range(100_000)]
    assert padding(25) == (4, 12) and padding(30) == (2, 6) and padding(fps) == (2, 6)


def test_windows_stay_on_device_and_dtype():
    features = torch.randn(60, 5, 384, dtype=torch.float16)
    w = audio_windows(features, 25)
    assert w.dtype == torch.float16 and w.device == features.device
    with pytest.raises(ValueError, match="expected features"):
        audio_windows(torch.randn(60, 384), 25)


@pytest.mark.parametrize("fps", [24, 25, 29.97, 30, 50, 59.94, 60])
def test_any_fps(fps):
    features = torch.randn(400, 5, 384)
    frames = num_frames(400 * 320, fps)
    assert torch.equal(audio_windows(features, fps, frames), loop_windows(features, as_fps(fps), frames))


@pytest.mark.parametrize("fps", [12.5, 25, 29.97, 30, 60])
def test_packaged_loop_baseline_equals_gather(fps):
    from lipstream.audio.windows import audio_windows_loop

    features = torch.randn(300, 5, 384)
    assert torch.equal(audio_windows_loop(features, fps, 170), audio_windows(features, fps, 170))
