"""What one WebRTC video frame costs to encode: aiortc's own VP8 and H.264 against the engine's x264
(and what aiortc's Opus costs a 20 ms audio frame).

`lipstream serve` sends the engine's H.264 (x264 in its worker processes) to clients that take
H.264 and lets aiortc encode raw frames for the others; this measures why. One thread, a moving
gradient (a talking head compresses better; the ratio is what counts):

    python -m lipstream.bench.webrtc_encode [--size 1280x720] [--frames 100]
"""

from __future__ import annotations

import argparse
import time
from fractions import Fraction

import av

from lipstream.fixtures.stream import gradient_i420
from lipstream.media.session_encoder import SessionEncoder


def _aiortc(mime: str, frames: list, fps: int) -> tuple[float, float]:
    from aiortc.codecs import get_encoder
    from aiortc.rtcrtpparameters import RTCRtpCodecParameters

    params = {"packetization-mode": "1", "profile-level-id": "42e01f"} if mime == "video/H264" else {}
    encoder = get_encoder(RTCRtpCodecParameters(mimeType=mime, clockRate=90_000, payloadType=96, parameters=params))
    size, t = 0, time.perf_counter()
    for k, i420 in enumerate(frames):
        frame = av.VideoFrame.from_ndarray(i420, format="yuv420p")
        frame.pts, frame.time_base = k * 90_000 // fps, Fraction(1, 90_000)
        payloads, _ = encoder.encode(frame)
        size += sum(map(len, payloads))
    return (time.perf_counter() - t) / len(frames), size * 8 * fps / len(frames)


def _opus(seconds: float = 4.0) -> float:
    """aiortc's Opus, as `lipstream serve` uses it for every session: seconds per 20 ms frame."""
    import numpy as np
    from aiortc.codecs import get_encoder
    from aiortc.rtcrtpparameters import RTCRtpCodecParameters

    from lipstream.fixtures import speech_like

    encoder = get_encoder(RTCRtpCodecParameters(mimeType="audio/opus", clockRate=48_000, channels=2, payloadType=111))
    pcm = (speech_like(seconds, 48_000, seed=1) * 32767).astype(np.int16)
    frames = range(0, pcm.size - 959, 960)
    t = time.perf_counter()
    for i in frames:
        frame = av.AudioFrame.from_ndarray(pcm[None, i:i + 960], format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = 48_000, i, Fraction(1, 48_000)
        encoder.encode(frame)
    return (time.perf_counter() - t) / len(frames)


def _x264(frames: list, fps: int) -> tuple[float, float]:
    h, w = frames[0].shape[0] * 2 // 3, frames[0].shape[1]
    encoder, size, t = SessionEncoder(w, h, Fraction(fps), audio="none"), 0, time.perf_counter()
    for k, i420 in enumerate(frames):
        size += sum(len(p.data) for p in encoder.encode(i420, k))
    return (time.perf_counter() - t) / len(frames), size * 8 * fps / len(frames)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1280x720")
    p.add_argument("--frames", type=int, default=100)
    p.add_argument("--fps", type=int, default=25)
    a = p.parse_args()
    w, h = (int(v) for v in a.size.split("x"))
    frames = [gradient_i420(k, w, h) for k in range(a.frames)]
    print(f"| {w}x{h}, {a.frames} frames | ms / frame | Mbit/s at {a.fps} fps |\n|---|---|---|")
    for name, (seconds, bits) in (("aiortc VP8 (its start rate)", _aiortc("video/VP8", frames, a.fps)),
                                  ("aiortc H.264 (its start rate)", _aiortc("video/H264", frames, a.fps)),
                                  ("engine x264 ultrafast, CRF 23", _x264(frames, a.fps))):
        print(f"| {name} | {seconds * 1000:.1f} | {bits / 1e6:.2f} |")
    print(f"\naiortc Opus (the audio of every session): {_opus() * 1000:.2f} ms a 20 ms frame")


if __name__ == "__main__":
    main()
