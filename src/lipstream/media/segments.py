"""One closed-GOP H.264 segment: the job of each of MP4Writer's parallel x264 encoders (threads or processes).

Kept free of torch and the rest of LipStream so a spawned encoder process starts in a blink
(it imports only PyAV and numpy).
"""

from __future__ import annotations

import os
from fractions import Fraction

import av
import numpy as np

GLOBAL_HEADER = 1 << 22  # AV_CODEC_FLAG_GLOBAL_HEADER: SPS/PPS in extradata (avcC), not in the stream

Encoded = tuple[bytes, int, int, bool]  # data, pts, dts (in frames), keyframe


def x264_context(width: int, height: int, fps: Fraction, options: dict[str, str], colorspace: int,
                 threads: int) -> av.VideoCodecContext:
    """An opened libx264 encoder; identical arguments give identical SPS/PPS (extradata)."""
    ctx = av.CodecContext.create("libx264", "w")
    ctx.width, ctx.height, ctx.pix_fmt = width, height, "yuv420p"
    ctx.time_base, ctx.framerate = 1 / fps, fps
    ctx.colorspace = colorspace
    ctx.options = dict(options)
    ctx.flags |= GLOBAL_HEADER
    ctx.thread_count = max(1, threads)
    ctx.open()
    return ctx


def encode_segment(frames: list[np.ndarray] | np.ndarray, start: int, width: int, height: int, fps: Fraction,
                   options: dict[str, str], colorspace: int, threads: int) -> list[Encoded]:
    """I420 frames -> packets with pts/dts counted in frames from the start of the video."""
    ctx = x264_context(width, height, fps, options, colorspace, threads)
    out: list[Encoded] = []
    for i, planes in enumerate(frames):
        frame = av.VideoFrame.from_ndarray(planes, format="yuv420p")
        frame.pts = i
        out += [(bytes(p), p.pts + start, p.dts + start, p.is_keyframe) for p in ctx.encode(frame)]
    out += [(bytes(p), p.pts + start, p.dts + start, p.is_keyframe) for p in ctx.encode(None)]
    return out


def default_threads(encoders: int) -> int:
    """x264 threads per segment encoder: the cores shared out, or $LIPSTREAM_X264_THREADS."""
    if os.environ.get("LIPSTREAM_X264_THREADS"):
        return max(1, int(os.environ["LIPSTREAM_X264_THREADS"]))
    return max(1, (os.cpu_count() or 1) // max(1, encoders))
