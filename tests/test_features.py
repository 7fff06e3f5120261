"""Whisper features: batched device log-mel + one encoder call == upstream's per-segment path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lipstream.audio import prepare_speech
from lipstream.audio.features import log_mel_segments, num_feature_steps, num_segments, whisper_features
from lipstream.fixtures import speech_like, write_audio


@pytest.fixture(scope="module")
def long_audio():
    return speech_like(61.0, seed=5)  # three segments: 30 + 30 + 1 s


def upstream_segments(audio, fe):
    """What MuseTalk does: cut 30 s segments, one feature-extractor call each (numpy path)."""
    return [fe._np_extract_fbank_features(np.pad(seg, (0, 480_000 - seg.size))[None], "cpu")[0]
            for seg in (audio[i:i + 480_000] for i in range(0, audio.size, 480_000))]


def feature_extractor():
    """transformers' WhisperFeatureExtractor: the reference (the test extra), never the runtime's."""
    return pytest.importorskip("transformers", reason="the reference comes with the test extra").WhisperFeatureExtractor()


def test_log_mel_matches_whisper_feature_extractor(long_audio, tiny_models):
    fe = feature_extractor()
    want = np.stack(upstream_segments(long_audio, fe))
    got = log_mel_segments(torch.from_numpy(long_audio), tiny_models.mel_filters).numpy()
    assert got.shape == (3, 80, 3000) == want.shape
    np.testing.assert_allclose(got, want, atol=2e-5)
    hf = fe([long_audio[:480_000]], sampling_rate=16000, return_tensors="np").input_features[0]
    np.testing.assert_allclose(got[0], hf, atol=2e-5)


def test_batched_encoder_equals_segment_loop(long_audio, tiny_models):
    fe, encoder = feature_extractor(), tiny_models.whisper
    got = whisper_features(long_audio, tiny_models)
    assert got.shape == (num_feature_steps(long_audio.size), 5, 384) == (3050, 5, 384)
    with torch.inference_mode():
        loop = [encoder(torch.from_numpy(m)[None])[0] for m in upstream_segments(long_audio, fe)]
    want = torch.cat(loop)[: got.shape[0]]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_lengths():
    assert num_segments(1) == 1 and num_segments(480_000) == 1 and num_segments(480_001) == 2
    # floor(n / 320), as upstream's trim to floor(n / 16000 * 50) steps; at least one step
    assert num_feature_steps(320) == 1 and num_feature_steps(639) == 1 and num_feature_steps(640) == 2
    assert num_feature_steps(16000) == 50 and num_feature_steps(16319) == 50 and num_feature_steps(100) == 1


def test_rejects_empty(tiny_models):
    with pytest.raises(ValueError, match="non-empty"):
        whisper_features(np.zeros(0, np.float32), tiny_models)


def test_prepare_speech_from_a_file(tmp_path, tiny_models):
    path = write_audio(tmp_path / "s.mp3", speech_like(2.5, 44_100), 44_100, channels=2)
    speech = prepare_speech(path, 29.97, tiny_models)
    assert abs(speech.duration - 2.5) < 0.06
    assert speech.frames == int(np.ceil(speech.samples.numel() * 30000 / 1001 / 16000))
    assert speech.windows.shape == (speech.frames, 50, 384)
    assert set(speech.timings_ms) == {"decode", "features", "windows", "total"}


def test_silence_is_valid(tiny_models):
    f = whisper_features(np.zeros(16000, np.float32), tiny_models)
    assert f.shape == (50, 5, 384) and torch.isfinite(f).all()
