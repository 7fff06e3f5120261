"""SessionEncoder: one packet per frame out at once, short closed GOPs with in-band SPS, audio that decodes."""

from __future__ import annotations

import math
from fractions import Fraction

import av
import numpy as np
import pytest

from lipstream.media.session_encoder import EncodedPacket, SessionEncoder
from lipstream.fixtures.stream import gradient_i420, nal_types, sine48

RATE = 48_000


def run_session(enc: SessionEncoder, frames: int, width: int, height: int, per_frame: int = 1920):
    video, audio = [], []
    for k in range(frames):
        out = enc.encode(gradient_i420(k, width, height), k, sine48(k * per_frame, per_frame))
        v = [p for p in out if p.kind == "video"]
        assert len(v) == 1 and v[0].pts == k and v[0].dts == k, "zerolatency: one packet per frame, at once"
        video += v
        audio += [p for p in out if p.kind == "audio"]
    tail = enc.flush()
    assert not [p for p in tail if p.kind == "video"]
    return video, audio + [p for p in tail if p.kind == "audio"]


def decode_audio(name: str, packets: list[EncodedPacket], extradata: bytes | None) -> np.ndarray:
    dec = av.CodecContext.create(name, "r")
    dec.sample_rate, dec.layout = RATE, "mono"
    dec.extradata = extradata
    chunks = [f.to_ndarray().reshape(-1) for p in packets for f in dec.decode(av.Packet(p.data))]
    return np.concatenate(chunks)


@pytest.fixture(scope="module")
def opus_session():
    enc = SessionEncoder(160, 96, Fraction(25), gop_frames=10, crf=18)
    return enc, *run_session(enc, 30, 160, 96)


def test_video_packets_one_per_frame_with_short_gop(opus_session):
    enc, video, _ = opus_session
    assert [p.pts for p in video] == list(range(30))
    assert all(p.dts == p.pts and p.time_base == Fraction(1, 25) for p in video)
    assert [p.pts for p in video if p.keyframe] == [0, 10, 20]
    assert video[3].time_s == pytest.approx(0.12)
    assert enc.video_extradata is None  # parameter sets travel in-band
    for key in (p for p in video if p.keyframe):
        assert key.data.startswith((b"\x00\x00\x00\x01", b"\x00\x00\x01"))
        assert {7, 8, 5} <= set(nal_types(key.data))  # SPS, PPS, IDR slice: a viewer can join here


def test_video_decodes_back_close_to_input(opus_session):
    _, video, _ = opus_session
    dec = av.CodecContext.create("h264", "r")
    frames = [f for p in video for f in dec.decode(av.Packet(p.data))] + list(dec.decode(None))
    assert len(frames) == 30
    for k, frame in enumerate(frames):
        assert (frame.width, frame.height) == (160, 96)
        luma = frame.to_ndarray(format="yuv420p")[:96].astype(np.int16)
        assert np.abs(luma - gradient_i420(k, 160, 96)[:96]).mean() < 3


def test_opus_audio_covers_input_and_decodes(opus_session):
    enc, _, audio = opus_session
    total, size = 30 * 1920, enc.audio_frame_size
    assert size == 960 and all(p.time_base == Fraction(1, RATE) for p in audio)
    assert [p.pts for p in audio] == [i * size for i in range(len(audio))]  # continuous from 0, rising
    # one extra packet holds the encoder's lookahead (Opus pre-skip, 312 samples) at the end
    assert len(audio) == math.ceil(total / size) + 1
    decoded = decode_audio("opus", audio, enc.audio_extradata)
    assert abs(len(decoded) - total) <= 2 * size
    rms = lambda x: float(np.sqrt(np.mean(np.square(x))))  # noqa: E731
    assert rms(decoded[size:total]) > 0.1 * rms(sine48(0, total))


def test_aac_variant():
    enc = SessionEncoder(64, 64, Fraction(25), audio="aac", gop_frames=5)
    video, audio = run_session(enc, 12, 64, 64)
    assert [p.pts for p in video if p.keyframe] == [0, 5, 10]
    total, size = 12 * 1920, enc.audio_frame_size
    assert size == 1024 and enc.audio_extradata
    assert [p.pts for p in audio] == [i * size for i in range(len(audio))]
    assert len(audio) * size >= total
    decoded = decode_audio("aac", audio, enc.audio_extradata)
    assert abs(len(decoded) - total) <= 2 * size
    assert np.sqrt(np.mean(np.square(decoded[2 * size:total]))) > 0.035  # 0.1 of the sine's RMS


def test_no_audio_and_skipped_indices():
    enc = SessionEncoder(64, 64, Fraction(30000, 1001), audio="none")
    assert enc.gop == 30
    packets = []
    for k in (0, 1, 2, 5, 6):
        out = enc.encode(gradient_i420(k, 64, 64), k, sine48(0, 1601))
        assert [(p.kind, p.pts, p.dts) for p in out] == [("video", k, k)]
        packets += out
    assert enc.flush() == []
    assert packets[0].keyframe and packets[0].time_base == Fraction(1001, 30000)
    with pytest.raises(ValueError):
        enc.encode(gradient_i420(6, 64, 64), 6)


def test_keyframes_by_time_and_on_request():
    enc = SessionEncoder(64, 64, Fraction(25), audio="none", gop_frames=4)
    keys = []
    for k in (0, 1, 2, 5, 6, 7, 8, 9, 11):  # gaps must not stretch the GOP in time
        if k == 11:
            enc.request_keyframe()
        keys += [p.pts for p in enc.encode(gradient_i420(k, 64, 64), k) if p.keyframe]
    assert keys == [0, 5, 9, 11]


def test_720p_frames():
    enc = SessionEncoder(1280, 720, Fraction(25), audio="none")
    out = [p for k in range(5) for p in enc.encode(gradient_i420(k, 1280, 720), k)] + enc.flush()
    assert [p.pts for p in out] == list(range(5)) and out[0].keyframe
    assert sum(p.keyframe for p in out) == 1
