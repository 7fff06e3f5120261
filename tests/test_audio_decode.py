"""Tests for lipstream.audio.decode.load_audio on real files of every common format.

Every file is written in the test (tmp_path) with lipstream.fixtures.media.write_audio, or with PyAV
directly where write_audio cannot make it (an mp4 with a video track, an AAC file with timestamps,
a WAV header with no samples).
"""

from __future__ import annotations

import fractions
import struct
from pathlib import Path

import av
import numpy as np
import pytest

import lipstream.audio.decode as decode
from lipstream.audio.decode import load_audio
from lipstream.errors import InputError
from lipstream.fixtures.media import write_audio

SR = 16_000  # load_audio's default output rate
FREQ = 440.0
AMP = 0.5
SINE_RMS = AMP / np.sqrt(2)  # 0.3536
LOSSY_LENGTH_TOL_S = 0.050


# ---------------------------------------------------------------- helpers

def sine(rate: int, seconds: float = 2.0, freq: float = FREQ, amp: float = AMP) -> np.ndarray:
    t = np.arange(int(round(rate * seconds))) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def dominant_freq(y: np.ndarray, rate: int = SR) -> float:
    spectrum = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    return float(np.fft.rfftfreq(len(y), 1 / rate)[spectrum.argmax()])


def rms(y: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(y, dtype=np.float64))))


def corr(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a, b)[0, 1])


def assert_basic(y: np.ndarray) -> None:
    assert isinstance(y, np.ndarray)
    assert y.ndim == 1
    assert y.dtype == np.float32
    assert y.flags["C_CONTIGUOUS"]
    assert np.isfinite(y).all()


def assert_sine_content(y: np.ndarray, rms_rel_tol: float) -> None:
    assert abs(dominant_freq(y) - FREQ) <= 5.0, dominant_freq(y)
    assert rms(y) == pytest.approx(SINE_RMS, rel=rms_rel_tol)


def assert_length_s(y: np.ndarray, seconds: float, tol_s: float) -> None:
    assert abs(len(y) / SR - seconds) <= tol_s, f"{len(y)} samples = {len(y) / SR:.4f} s, expected {seconds} s"


def encode_all(container, stream, samples: np.ndarray, rate: int, layout: str) -> None:
    """Encode float [channels, n] samples with proper timestamps (so muxers record the encoder delay)."""
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="fltp", layout=layout)
    frame.sample_rate = rate
    frame.pts = 0
    frame.time_base = fractions.Fraction(1, rate)
    resampler = av.AudioResampler(format=stream.codec_context.format.name, layout=layout, rate=rate,
                                  frame_size=stream.codec_context.frame_size or None)
    for out in [*resampler.resample(frame), *resampler.resample(None)]:
        for packet in stream.encode(out):
            container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)


def write_aac_with_timestamps(path: Path, samples: np.ndarray, rate: int) -> Path:
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=rate, layout="mono")
        encode_all(container, stream, samples[None], rate, "mono")
    return path


def write_mp4(path: Path, seconds: float = 2.0, audio_rate: int | None = 44_100) -> Path:
    """An H.264 (libx264, 64x64, yuv420p, 25 fps) mp4, with an AAC 440 Hz sine track unless audio_rate is None."""
    fps = 25
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=fps)
        video.width, video.height, video.pix_fmt = 64, 64, "yuv420p"
        audio = container.add_stream("aac", rate=audio_rate, layout="mono") if audio_rate else None
        for i in range(int(seconds * fps)):
            image = np.full((64, 64, 3), (i * 5) % 256, np.uint8)
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = i
            for packet in video.encode(frame):
                container.mux(packet)
        for packet in video.encode(None):
            container.mux(packet)
        if audio is not None:
            encode_all(container, audio, sine(audio_rate, seconds)[None], audio_rate, "mono")
    return path


def empty_wav_header(path: Path, rate: int = SR) -> Path:
    """A valid 44-byte PCM s16 mono RIFF/WAVE header whose data chunk holds zero samples."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    data = b""
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    assert path.stat().st_size == 44
    return path


def truncate_to_half(src: Path, dst: Path) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) // 2])
    return dst


def raises_input_error(path: Path | str, *fragments: str) -> InputError:
    with pytest.raises(InputError) as info:
        load_audio(path)
    message = str(info.value)
    assert str(path) in message
    assert Path(info.value.path) == Path(path)
    assert "\n" not in message
    low = message.lower()
    assert any(f in low for f in fragments), message
    return info.value
    return info.value


# ---------------------------------------------------------------- 1. formats: lossless PCM

PCM_WAVS = [
    # id, write_audio kwargs, max abs error vs the source sine, min correlation
    pytest.param(dict(bits=8), 1 / 128, 0.999, id="wav-u8"),
    pytest.param(dict(bits=16), 1 / 32768 + 1e-7, 0.9999, id="wav-s16"),
    pytest.param(dict(bits=24), 2 ** -22, 0.9999, id="wav-s24"),
    pytest.param(dict(bits=32), 1e-6, 0.9999, id="wav-s32"),
    pytest.param(dict(codec="pcm_f32le"), 1e-7, 0.9999, id="wav-f32"),
]


@pytest.mark.parametrize("kwargs, max_err, min_corr", PCM_WAVS)
def test_pcm_wav_16k_is_exact(tmp_path, kwargs, max_err, min_corr):
    src = sine(SR, 2.0)
    y = load_audio(write_audio(tmp_path / "a.wav", src, SR, **kwargs))
    assert_basic(y)
    assert len(y) == len(src) == 32_000
    assert corr(y, src) > min_corr
    assert np.abs(y - src).max() <= max_err
    assert_sine_content(y, rms_rel_tol=0.01)


def test_pcm_wav_bit_depths_really_differ(tmp_path):
    """Guard for the test above: the fixture must write genuinely different sample widths."""
    sizes = {}
    for name, kwargs in [("u8", dict(bits=8)), ("s16", dict(bits=16)), ("s24", dict(bits=24)),
                         ("s32", dict(bits=32)), ("f32", dict(codec="pcm_f32le"))]:
        path = write_audio(tmp_path / f"{name}.wav", sine(SR, 1.0), SR, **kwargs)
        with av.open(str(path)) as c:
            sizes[name] = (c.streams.audio[0].codec_context.name, path.stat().st_size)
    assert sizes["u8"][0] == "pcm_u8" and sizes["s16"][0] == "pcm_s16le" and sizes["s24"][0] == "pcm_s24le"
    assert sizes["s32"][0] == "pcm_s32le" and sizes["f32"][0] == "pcm_f32le"
    assert sizes["u8"][1] < sizes["s16"][1] < sizes["s24"][1] < sizes["s32"][1]


def test_flac_is_exact(tmp_path):
    src = sine(SR, 2.0)
    y = load_audio(write_audio(tmp_path / "a.flac", src, SR))
    assert_basic(y)
    assert len(y) == len(src)
    assert corr(y, src) > 0.9999
    assert np.abs(y - src).max() <= 1 / 32768 + 1e-7  # flac from s16
    assert_sine_content(y, rms_rel_tol=0.01)


def test_accepts_str_and_path(tmp_path):
    path = write_audio(tmp_path / "a.wav", sine(SR, 1.0), SR)
    np.testing.assert_array_equal(load_audio(path), load_audio(str(path)))


# ---------------------------------------------------------------- 1. formats: lossy codecs

LOSSY = [
    # file name, source rate, channels
    pytest.param("a.mp3", 44_100, 2, id="mp3-stereo-44k1"),
    pytest.param("a.m4a", SR, 1, id="m4a-aac-16k"),
    pytest.param("a.m4a", 44_100, 1, id="m4a-aac-44k1"),
    pytest.param("a.ogg", 48_000, 1, id="ogg-opus-48k"),
]


@pytest.mark.parametrize("name, rate, channels", LOSSY)
def test_lossy_content(tmp_path, name, rate, channels):
    y = load_audio(write_audio(tmp_path / name, sine(rate, 2.0), rate, channels=channels))
    assert_basic(y)
    assert_sine_content(y, rms_rel_tol=0.10)
    # a 0.5 sine, not summed channels (away from the ends: AAC rings up to ~0.93 where the sine stops dead)
    assert np.abs(y[SR // 10: -SR // 10]).max() < 0.6


def test_mp3_fixture_is_stereo_44k1(tmp_path):
    path = write_audio(tmp_path / "a.mp3", sine(44_100, 1.0), 44_100, channels=2)
    with av.open(str(path)) as c:
        ctx = c.streams.audio[0].codec_context
        assert c.format.name == "mp3"
        assert (ctx.sample_rate, ctx.channels) == (44_100, 2)


@pytest.mark.parametrize("name, rate, channels", [
    pytest.param("a.mp3", 44_100, 2, id="mp3-stereo-44k1"),
    pytest.param("a.ogg", 48_000, 1, id="ogg-opus-48k"),
    pytest.param("a.m4a", 44_100, 1, id="m4a-aac-44k1"),
    pytest.param("a.m4a", SR, 1, id="m4a-aac-16k"),
])
def test_lossy_length(tmp_path, name, rate, channels):
    y = load_audio(write_audio(tmp_path / name, sine(rate, 2.0), rate, channels=channels))
    assert_length_s(y, 2.0, LOSSY_LENGTH_TOL_S)


def test_m4a_with_timestamps_length_and_content(tmp_path):
    """An AAC file whose edit list records the encoder delay loads to the source duration (priming dropped)."""
    y = load_audio(write_aac_with_timestamps(tmp_path / "a.m4a", sine(SR, 2.0), SR))
    assert_basic(y)
    assert_length_s(y, 2.0, LOSSY_LENGTH_TOL_S)
    assert_sine_content(y, rms_rel_tol=0.10)
    assert np.abs(y[:400]).max() > 0.2  # the sine starts right away: no 64 ms of priming silence


# ---------------------------------------------------------------- 1. formats: audio track of a video

def test_mp4_video_with_aac_audio(tmp_path):
    path = write_mp4(tmp_path / "clip.mp4", seconds=2.0, audio_rate=44_100)
    with av.open(str(path)) as c:  # the video stream comes first, so load_audio must pick the audio one
        assert [(s.type, s.codec_context.name) for s in c.streams] == [("video", "h264"), ("audio", "aac")]
        assert (c.streams.video[0].width, c.streams.video[0].height) == (64, 64)
    y = load_audio(path)
    assert_basic(y)
    assert_length_s(y, 2.0, LOSSY_LENGTH_TOL_S)
    assert_sine_content(y, rms_rel_tol=0.10)


# ---------------------------------------------------------------- 2. stereo downmix

@pytest.mark.parametrize("rate", [SR, 44_100])
def test_stereo_opposite_channels_cancel(tmp_path, rate):
    s = sine(rate, 1.0)
    y = load_audio(write_audio(tmp_path / "a.wav", np.stack([s, -s]), rate))
    assert_basic(y)
    assert len(y) == SR
    assert np.abs(y).max() < 1e-3


@pytest.mark.parametrize("rate", [SR, 44_100])
def test_stereo_identical_channels_keep_amplitude(tmp_path, rate):
    s = sine(rate, 1.0)
    y = load_audio(write_audio(tmp_path / "a.wav", np.stack([s, s]), rate))
    assert_basic(y)
    assert len(y) == SR
    assert np.abs(y).max() == pytest.approx(AMP, abs=0.01)  # mean of channels, not a sum / power-preserving mix
    assert rms(y) == pytest.approx(SINE_RMS, rel=0.01)
    assert corr(y, sine(SR, 1.0)) > 0.9999


def test_stereo_one_silent_channel_halves(tmp_path):
    s = sine(SR, 1.0)
    y = load_audio(write_audio(tmp_path / "a.wav", np.stack([s, np.zeros_like(s)]), SR))
    np.testing.assert_allclose(y, s / 2, atol=1e-4)


def test_stereo_mp3_opposite_channels_cancel(tmp_path):
    s = sine(44_100, 1.0)
    y = load_audio(write_audio(tmp_path / "a.mp3", np.stack([s, -s]), 44_100))
    assert rms(y) < 0.05 * SINE_RMS


# ---------------------------------------------------------------- 3. resampling

@pytest.mark.parametrize("rate", [8_000, 22_050, 44_100, 48_000])
def test_resample_to_16k(tmp_path, rate):
    seconds = 1.5
    y = load_audio(write_audio(tmp_path / f"a{rate}.wav", sine(rate, seconds), rate))
    assert_basic(y)
    assert abs(len(y) - seconds * SR) <= SR * 0.001  # duration within 1 ms
    ref = sine(SR, seconds)[: len(y)]
    inner = slice(200, len(y) - 200)  # the filter's edges ramp in and out
    assert corr(y[inner], ref[inner]) > 0.999  # right frequency and no time shift
    assert np.abs(y[inner] - ref[inner]).max() < 1e-3
    assert_sine_content(y, rms_rel_tol=0.02)


@pytest.mark.parametrize("target", [8_000, 22_050, 48_000])
def test_sample_rate_argument(tmp_path, target):
    seconds = 1.5
    y = load_audio(write_audio(tmp_path / "a.wav", sine(44_100, seconds), 44_100), sample_rate=target)
    assert_basic(y)
    assert abs(len(y) - seconds * target) <= target * 0.001
    spectrum = np.abs(np.fft.rfft(y * np.hanning(len(y))))
    assert abs(np.fft.rfftfreq(len(y), 1 / target)[spectrum.argmax()] - FREQ) <= 5.0


# ---------------------------------------------------------------- 4. bad files

def test_missing_file(tmp_path):
    raises_input_error(tmp_path / "nope.wav", "no such")


def test_missing_file_str_path(tmp_path):
    raises_input_error(str(tmp_path / "nope.wav"), "no such")


def test_folder(tmp_path):
    folder = tmp_path / "clips.wav"
    folder.mkdir()
    raises_input_error(folder, "folder")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.wav"
    path.write_bytes(b"")
    raises_input_error(path, "is empty (0 bytes)")


@pytest.mark.parametrize("name", ["noise.wav", "noise.mp3", "noise.mp4", "noise.bin"])
def test_random_bytes(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(np.random.default_rng(0).bytes(5000))
    raises_input_error(path, "not a readable audio or video file")


@pytest.mark.parametrize("name", ["notes.txt", "notes.wav"])
def test_text_file(tmp_path, name):
    path = tmp_path / name
    path.write_text("this is not audio\n" * 50)
    # FFmpeg's probe takes a .txt file for "tty" (ANSI art: a video stream only)
    raises_input_error(path, "no audio stream", "not a readable audio or video file")


@pytest.mark.parametrize("kwargs", [
    pytest.param(dict(bits=8), id="u8"), pytest.param(dict(bits=16), id="s16"),
    pytest.param(dict(bits=24), id="s24"), pytest.param(dict(codec="pcm_f32le"), id="f32"),
])
def test_truncated_wav(tmp_path, kwargs):
    full = write_audio(tmp_path / "full.wav", sine(SR, 2.0), SR, **kwargs)
    assert load_audio(full).size == 32_000  # the intact file is fine
    raises_input_error(truncate_to_half(full, tmp_path / "cut.wav"), "truncated")


def test_truncated_stereo_44k1_wav(tmp_path):
    s = sine(44_100, 2.0)
    full = write_audio(tmp_path / "full.wav", np.stack([s, s]), 44_100)
    raises_input_error(truncate_to_half(full, tmp_path / "cut.wav"), "truncated")


def test_truncated_mp3(tmp_path):
    full = write_audio(tmp_path / "full.mp3", sine(44_100, 2.0), 44_100, channels=2)
    assert len(load_audio(full)) == pytest.approx(32_000, abs=800)
    raises_input_error(truncate_to_half(full, tmp_path / "cut.mp3"), "truncated")


def test_truncated_flac(tmp_path):
    full = write_audio(tmp_path / "full.flac", sine(SR, 2.0), SR)
    raises_input_error(truncate_to_half(full, tmp_path / "cut.flac"), "truncated")


def test_truncated_m4a(tmp_path):
    # the moov atom sits at the end of the file, so half an m4a cannot even be opened
    full = write_audio(tmp_path / "full.m4a", sine(SR, 2.0), SR)
    raises_input_error(truncate_to_half(full, tmp_path / "cut.m4a"), "truncated", "not a readable")


def test_truncated_short_wav(tmp_path):
    full = write_audio(tmp_path / "full.wav", sine(SR, 0.8), SR)
    raises_input_error(truncate_to_half(full, tmp_path / "cut.wav"), "truncated")


def test_wav_header_with_zero_samples(tmp_path):
    raises_input_error(empty_wav_header(tmp_path / "zero.wav"), "no audio samples")


def test_video_only_mp4(tmp_path):
    path = write_mp4(tmp_path / "silent_film.mp4", seconds=1.0, audio_rate=None)
    with av.open(str(path)) as c:
        assert [s.type for s in c.streams] == ["video"]
    raises_input_error(path, "no audio stream")


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_samples(tmp_path, value):
    s = sine(SR, 1.0)
    s[8000] = value
    err = raises_input_error(write_audio(tmp_path / "bad.wav", s, SR, codec="pcm_f32le"), "nan or infinite")
    assert "0.500 s" in str(err)


def test_too_long(tmp_path, monkeypatch):
    path = write_audio(tmp_path / "a.wav", sine(SR, 2.0), SR)
    monkeypatch.setattr(decode, "MAX_SECONDS", 1)
    raises_input_error(path, "split it first")


# ---------------------------------------------------------------- 5. silence is valid audio

@pytest.mark.parametrize("name, rate", [
    pytest.param("z.wav", SR, id="wav"), pytest.param("z.flac", SR, id="flac"),
    pytest.param("z.mp3", 44_100, id="mp3"), pytest.param("z.ogg", 48_000, id="opus"),
])
def test_silence_decodes_to_zeros(tmp_path, name, rate):
    y = load_audio(write_audio(tmp_path / name, np.zeros(2 * rate, np.float32), rate))
    assert_basic(y)
    assert_length_s(y, 2.0, 0.0 if name.endswith((".wav", ".flac")) else LOSSY_LENGTH_TOL_S)
    assert np.abs(y).max() <= 1e-4
