"""Write H.264 (libx264, yuv420p) + AAC into one MP4 in a single pass, atomically.

Frames arrive as I420 planes, exactly what x264 takes: no colour conversion on the CPU. Audio is
encoded alongside, up to the time of the last video frame, so the muxer gets interleaved
packets. `+faststart` puts the index first so browsers start playing at once. The file is written
under a temporary name beside the output and renamed only when complete.

One libx264 tops out near 160 fps at 1080p even with 16 threads. With `encoders > 1` the video
is cut into closed-GOP segments, each encoded by its own x264 in a thread pool (PyAV releases
the GIL while x264 works) or, with `processes=True`, in the process's pool of encode worker
processes (media/segment_pool.py: the frames go through shared memory, and the Python around
x264 runs under the workers' own GILs); the packets are muxed in order into the one track,
without any re-encode. Identical settings give identical SPS/PPS, so one avcC serves all
segments. The first segments are short so the first encoded frame comes out quickly.

Joining segments: with B-frames x264 stamps decode times `delay` frames before presentation
times, but a segment too short to hold a B-frame comes out with no delay, so the segments' own
DTS overlap at the joins. The joined track therefore gets its DTS renumbered: packet k in
decode order has DTS k - delay, with `delay` the largest these settings ever use (probed once
per settings). Each segment's packets keep their order and PTS, and DTS <= PTS still holds,
since each segment's own delay is at most that. The first DTS is -delay, as from one encoder:
the MP4 muxer's edit list then starts the video at 0.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from lipstream.files import atomic_path
from lipstream.media.segments import GLOBAL_HEADER, default_threads, encode_segment, x264_context
from lipstream.media.rates import AUDIO_RATE

AAC_FRAME = 1024
# Segment lengths: short first, then the last one repeated. x264 hands out packets only when a
# segment is flushed: a 2-frame first segment measured 0.12-0.19 s to the first packet, 4 frames 0.20-0.23 s.
SEGMENT_FRAMES = (2, 8, 16, 32)
TAIL_FRAMES = 8  # the shortest segment near the end
_EXTRADATA: dict[str, bytes | None] = {}  # SPS/PPS per encoder settings: opening an x264 costs ~10 ms
_DTS_DELAY: dict[str, int] = {}  # B-frame reorder delay (frames) per encoder settings


def arena_slots(encoders: int, segment: int = SEGMENT_FRAMES[-1]) -> int:
    """Frames a writer's shared-memory arena holds: in use at most, the segment being filled and
    encoders + 1 in flight (write's block)."""
    return (encoders + 2) * max(*SEGMENT_FRAMES[:-1], segment)


def _extradata(args: tuple) -> bytes | None:
    key = repr(args)  # the options dict makes the tuple unhashable; its repr is as good a key
    if key not in _EXTRADATA:
        _EXTRADATA[key] = x264_context(*args).extradata or None
    return _EXTRADATA[key]


def dts_delay(options: dict[str, str]) -> int:
    """Frames by which x264 with these options stamps DTS before PTS (0 without B-frames).

    It depends on the settings only (B-frames, pyramid), not on the picture: a 16-frame encode
    of a tiny still tells, once per settings.
    """
    key = repr(sorted(options.items()))
    if key not in _DTS_DELAY:
        ctx = x264_context(64, 64, Fraction(25), options, 1, 1)
        planes = np.full((96, 64), 128, np.uint8)
        dts = []
        for i in range(16):
            frame = av.VideoFrame.from_ndarray(planes, format="yuv420p")
            frame.pts = i
            dts += [p.dts for p in ctx.encode(frame)]
        dts += [p.dts for p in ctx.encode(None)]
        _DTS_DELAY[key] = max(0, -min(dts))
    return _DTS_DELAY[key]


class MP4Writer:
    """Use as a context manager; the output appears only if the block finishes without an exception."""

    def __init__(self, dest: str | Path, width: int, height: int, fps: Fraction, audio: np.ndarray,
                 *, sample_rate: int = AUDIO_RATE, crf: int = 18, x264_preset: str = "veryfast",
                 matrix: str = "bt601", audio_bitrate: int = 128_000, encoders: int = 1,
                 processes: bool = False, segment: int = SEGMENT_FRAMES[-1], total_frames: int | None = None):
        self.dest = Path(dest)
        self.encoders = max(1, encoders)
        self.total_frames = total_frames
        self.first_packet_at: float | None = None  # perf_counter() when the first video packet was muxed
        self.first_submit_at: float | None = None  # perf_counter() when the first segment went to an encoder
        self.disk_bytes_written = 0  # nothing on the way: frames go straight into the encoders
        self.fps = Fraction(fps)
        self.audio = np.ascontiguousarray(audio, dtype=np.float32)
        if not np.isfinite(self.audio).all():  # the AAC encoder would stop mid-file with "returned 22"
            raise ValueError("audio holds NaN or infinite samples")
        self.rate = sample_rate
        self.frames = 0
        self._audio_pos = 0
        self._atomic = atomic_path(self.dest)
        self._tmp = self._atomic.__enter__()
        try:
            self.container = av.open(str(self._tmp), "w", format="mp4", options={"movflags": "+faststart"})
            self.video = self.container.add_stream("libx264", rate=self.fps,
                                                   options={"crf": str(crf), "preset": x264_preset})
            self.video.width, self.video.height, self.video.pix_fmt = width, height, "yuv420p"
            self.video.codec_context.time_base = 1 / self.fps
            self.video.codec_context.colorspace = {"bt709": 1, "bt601": 6}[matrix]  # tag what we blended in
            self._x264 = {"crf": str(crf), "preset": x264_preset}
            self._matrix = matrix
            self._segment: list = []
            self._video_packets = 0  # muxed so far: the joined track's decode order
            self._segment_start = 0
            self._segments_done = 0
            # a segment's frames: buffers (threads) or slots of the shared arena (processes)
            self._pending: deque[tuple[Future, list]] = deque()
            self._free: list = []  # recycled buffers (or free slots) of finished segments
            self._pool = None
            self._arena = None
            self._sizes = (*SEGMENT_FRAMES[:-1], segment)
            if self.encoders > 1:
                self._segment_args = (width, height, self.fps, self._x264, self.video.codec_context.colorspace,
                                      default_threads(self.encoders))
                self.video.codec_context.flags |= GLOBAL_HEADER
                self.video.codec_context.extradata = _extradata(self._segment_args)
                self._dts_delay = dts_delay(self._x264)
                if processes:
                    from lipstream.media.segment_pool import segment_pool

                    self._pool = segment_pool(self.encoders)
                    self._arena = self._pool.arena(width, height, arena_slots(self.encoders, segment))
                    self._free = list(range(self._arena.slots)) if self._arena is not None else []
                if self._arena is None:
                    self._pool = ThreadPoolExecutor(self.encoders, thread_name_prefix="x264-segment")
            self.audio_stream = self.container.add_stream("aac", rate=sample_rate, layout="mono")
            self.audio_stream.bit_rate = audio_bitrate
        except BaseException as e:
            if getattr(self, "_arena", None) is not None:
                self._arena.close()
            self._atomic.__exit__(type(e), e, e.__traceback__)
            raise

    def __enter__(self) -> "MP4Writer":
        return self

    def write(self, planes: np.ndarray) -> None:
        """Append one [H*3/2, W] uint8 I420 frame (and the audio up to its end).

        `planes` is copied (or encoded) before this returns: the caller may reuse its buffer.
        """
        self.frames += 1
        if self._pool is not None:
            if self._arena is not None:
                if not self._free:  # cannot happen with write's block; a wait rather than a crash
                    self._mux_ready(block=True)
                slot = self._free.pop()
                np.copyto(self._arena.frames[slot], planes)
                self._segment.append(slot)
            else:
                buffer = self._free.pop() if self._free else np.empty_like(planes)
                np.copyto(buffer, planes)
                self._segment.append(buffer)
            if len(self._segment) >= self._segment_size():
                self._submit()
            self._mux_ready(block=len(self._pending) > self.encoders)
            return
        frame = av.VideoFrame.from_ndarray(planes, format="yuv420p")
        frame.pts, frame.time_base = self.frames - 1, 1 / self.fps
        for packet in self.video.encode(frame):
            self._mux_video(packet)
        self._write_audio(int(self.frames / self.fps * self.rate))

    def _mux_video(self, packet: av.Packet) -> None:
        self.container.mux(packet)
        if self.first_packet_at is None:
            self.first_packet_at = time.perf_counter()

    def poll(self) -> None:
        """Mux whatever segments have finished (call it while waiting for frames)."""
        if self._pool is not None:
            self._mux_ready(block=False)

    def _segment_size(self) -> int:
        started = self._segments_done + len(self._pending)
        size = self._sizes[min(started, len(self._sizes) - 1)]
        if self.total_frames:  # near the end: split what is left across the encoders
            left = self.total_frames - self._segment_start
            size = min(size, max(TAIL_FRAMES, -(-left // self.encoders)))
        return size

    def _submit(self) -> None:
        if self._segment:
            args = self._segment_args
            if self._segment_start == 0:  # alone on the cores: the first packet sooner
                args = (*args[:-1], max(args[-1], default_threads(2)))
            if self._arena is not None:
                future = self._pool.submit(self._arena, self._segment, self._segment_start, *args)
            else:
                future = self._pool.submit(encode_segment, self._segment, self._segment_start, *args)
            self.first_submit_at = self.first_submit_at or time.perf_counter()
            self._pending.append((future, self._segment))
            self._segment_start += len(self._segment)
            self._segment = []

    def _mux_ready(self, block: bool) -> None:
        """Mux finished segments in order (waiting for the oldest when `block`)."""
        while self._pending and (block or self._pending[0][0].done()):
            future, buffers = self._pending.popleft()
            encoded = future.result()
            self._free.extend(buffers)
            block = False
            for data, pts, _, key in encoded:  # the segment's own DTS may overlap the last one's: renumber
                dts = self._video_packets - self._dts_delay
                if dts > pts:
                    raise RuntimeError(f"x264 packet of frame {pts} is reordered by more than "
                                       f"{self._dts_delay} frames")
                packet = av.Packet(data)
                packet.pts, packet.dts, packet.is_keyframe = pts, dts, key
                self._video_packets += 1
                packet.time_base, packet.stream = 1 / self.fps, self.video
                self._mux_video(packet)
            self._segments_done += 1
            end = max((pts for _, pts, _, _ in encoded), default=-1) + 1
            self._write_audio(int(end / self.fps * self.rate))

    def _close_pool(self, wait: bool = True) -> None:
        """The thread pool ends with the writer; the worker processes stay for the next, and so does the
        arena after a finished write (its pages are in: segment_pool.py), not after an aborted one."""
        if self._arena is not None:
            self._arena.release() if wait else self._arena.close()
        else:
            self._pool.shutdown(wait=wait, cancel_futures=not wait)

    def worker_cpu_s(self) -> float:
        """CPU time of the encoder processes so far (0 with threads: the process's own time counts them)."""
        return self._pool.cpu_s() if self._arena is not None else 0.0

    def _write_audio(self, until: int, final: bool = False) -> None:
        until = min(until, self.audio.size)
        while self._audio_pos < until and (final or until - self._audio_pos >= AAC_FRAME):
            chunk = self.audio[self._audio_pos:self._audio_pos + min(AAC_FRAME, until - self._audio_pos)]
            frame = av.AudioFrame.from_ndarray(chunk[None], format="fltp", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = self.rate, self._audio_pos, Fraction(1, self.rate)
            for packet in self.audio_stream.encode(frame):
                self.container.mux(packet)
            self._audio_pos += chunk.size

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                if self._pool is not None:
                    self._submit()
                    while self._pending:
                        self._mux_ready(block=True)
                    self._close_pool()
                else:
                    for packet in self.video.encode(None):
                        self._mux_video(packet)
                self._write_audio(self.audio.size, final=True)
                for packet in self.audio_stream.encode(None):
                    self.container.mux(packet)
                self.container.close()
            except BaseException as e:
                with contextlib.suppress(Exception):
                    self.container.close()
                self._atomic.__exit__(type(e), e, e.__traceback__)
                raise
            self._atomic.__exit__(None, None, None)
        else:
            if self._pool is not None:
                # Queued segments are cancelled; running ones are not waited for (a 1080p segment takes
                # over a second, and Ctrl-C must stop within one): they only return packets, which are
                # dropped, and never touch the file. A worker process finishes what it was sent first.
                for future, _ in self._pending:
                    future.cancel()
                self._close_pool(wait=False)
            with contextlib.suppress(Exception):
                self.container.close()
            self._atomic.__exit__(exc_type, exc, tb)
