"""Pictures for pip and cutaway: a still (Pillow) or a video (PyAV), fitted into a box keeping its aspect.

A video is decoded as the render goes, forward only, by a thread that reads a few frames ahead (the
decoder drops the GIL, so this runs beside the render's own thread). `VideoSource.frame_at(t)`
returns the frame whose presentation interval covers t seconds since the span's start: the show's
clock, not a frame count, so a 30 fps clip in a 25 fps show plays at its own speed. Past its end a
video loops or holds its last frame.

Frames come back as the decoder made them where that is plain limited-range I420 in BT.601/709 (almost
every H.264/HEVC file): the compositor uploads the planes and scales and converts them on the device,
since swscale's scaling and RGB conversion on the CPU cost three times the decode of a 1080p frame.
Anything else (full range, 4:2:2, 10-bit, RGB codecs, odd sizes) is converted by swscale to RGB at the
box's size here.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from lipstream.errors import InputError
from lipstream.files import check_file
from lipstream.media.demux import open_input
from lipstream.media.pixels import i420_to_rgb

STILL_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff"}
READ_AHEAD_BYTES = 96 << 20  # decoded frames waiting per video: a render's batch of 1080p I420 frames,
READ_AHEAD_FRAMES = (6, 64)  # so the decoder works while the GPU renders, not while the batch waits
EPS = 1e-6  # seconds: a frame starting within this of t covers t (float times of the same rational)

Box = tuple[int, int, int, int]


def _still(path: Path) -> Image.Image | None:
    """The image at `path` if Pillow reads it (still suffix or not), else None."""
    try:
        with Image.open(path) as im:
            if getattr(im, "n_frames", 1) > 1 and path.suffix.lower() not in STILL_SUFFIXES:
                return None  # an animated GIF/WebP plays as a video
            im.load()
            return im.convert("RGBA")
    except (UnidentifiedImageError, OSError, ValueError):
        return None


def probe_picture(path: str | Path) -> tuple[int, int, float | None]:
    """(width, height, duration in seconds, None for a still); InputError for a missing or undecodable file."""
    p = check_file(path, "picture")
    im = _still(p)
    if im is not None:
        return im.width, im.height, None
    try:
        with open_input(p) as container:
            if not container.streams.video:
                raise InputError(p, "has no video stream; a pip or cutaway takes an image or a video")
            stream = container.streams.video[0]
            first = next(container.decode(stream), None)
            if first is None:
                raise InputError(p, "a video with no frame that can be decoded")
            duration = None
            if stream.duration and stream.time_base:
                duration = float(stream.duration * stream.time_base)
            elif container.duration:
                duration = container.duration / 1e6
            return first.width, first.height, duration or 1.0 / float(stream.average_rate or 25)
    except InputError:
        raise
    except (av.error.FFmpegError, OSError, StopIteration, ValueError):
        raise InputError(p, "not an image or video that Pillow or FFmpeg can decode") from None


def fit_box(src_w: int, src_h: int, box: Box) -> Box:
    """The rectangle (x1, y1, x2, y2) inside `box` that a src_w x src_h picture fills keeping its aspect,
    centred, with even corners (I420's chroma)."""
    bx1, by1 = (box[0] + 1) // 2 * 2, (box[1] + 1) // 2 * 2
    bx2, by2 = box[2] // 2 * 2, box[3] // 2 * 2
    bw, bh = bx2 - bx1, by2 - by1
    if bw < 2 or bh < 2:
        raise ValueError(f"box {box!r} is smaller than 2 x 2 pixels")
    if src_w * bh >= src_h * bw:  # wider than the box: full width, bars above and below
        w, h = bw, max(2, round(bw * src_h / src_w / 2) * 2)
    else:
        w, h = max(2, round(bh * src_w / src_h / 2) * 2), bh
    w, h = min(w, bw), min(h, bh)
    x1 = bx1 + (bw - w) // 4 * 2
    y1 = by1 + (bh - h) // 4 * 2
    return x1, y1, x1 + w, y1 + h


def load_still(path: str | Path, size: tuple[int, int]) -> np.ndarray:
    """The still at `path` resized to `size` (w, h), [h, w, 4] RGBA uint8 (a PNG's alpha kept)."""
    p = check_file(path, "picture")
    im = _still(p)
    if im is None:
        raise InputError(p, "not an image Pillow can decode")
    if im.size != tuple(size):
        im = im.resize(tuple(size), Image.LANCZOS)
    return np.asarray(im).copy()


# AVColorSpace codes (frame.colorspace) of the matrices the device path converts; 2 = unspecified
_MATRIX_OF_COLORSPACE = {1: "bt709", 2: "bt601", 5: "bt601", 6: "bt601"}


@dataclass(frozen=True)
class SourceFrame:
    """One decoded frame: `layout` "i420": packed I420 [h*3/2, w] uint8 at the source's size, limited range,
    in `matrix`; "rgb": [h, w, 3] uint8 already at the box's size."""

    pixels: np.ndarray
    layout: str
    matrix: str | None = None
    pinned: "torch.Tensor | None" = None  # `pixels`' memory as a pinned tensor, for an async upload to CUDA

    def rgb(self, size: tuple[int, int]) -> np.ndarray:
        """The frame as RGB [h, w, 3] uint8 at `size` (w, h), on the CPU (for tests and CPU consumers)."""
        if self.layout == "rgb":
            return self.pixels
        return i420_to_rgb(self.pixels, self.matrix or "bt601", size=size)


def _device_path(frame: av.VideoFrame) -> str | None:
    """The source matrix when the frame can go to the device as it is (plain limited-range 4:2:0)."""
    if frame.format.name != "yuv420p" or frame.width % 2 or frame.height % 2 or frame.color_range == 2:
        return None
    return _MATRIX_OF_COLORSPACE.get(int(frame.colorspace))


def _i420(frame: av.VideoFrame, pin: bool) -> SourceFrame:
    """The frame's planes copied once, straight into packed I420 (in pinned memory when `pin`)."""
    w, h = frame.width, frame.height
    pinned = torch.empty((h * 3 // 2, w), dtype=torch.uint8, pin_memory=True) if pin else None
    out = pinned.numpy() if pinned is not None else np.empty((h * 3 // 2, w), np.uint8)
    flat = out.reshape(-1)
    at = 0
    for plane, (pw, ph) in zip(frame.planes, ((w, h), (w // 2, h // 2), (w // 2, h // 2))):
        src = np.frombuffer(plane, np.uint8)[: plane.line_size * ph].reshape(ph, plane.line_size)[:, :pw]
        np.copyto(flat[at:at + pw * ph].reshape(ph, pw), src)
        at += pw * ph
    return SourceFrame(out, "i420", _device_path(frame), pinned)


@dataclass
class _Frame:
    start: float  # seconds since the video's first frame, including the loops before it
    end: float | None  # None: the last frame of a held video, or not yet known
    picture: SourceFrame


class VideoSource:
    """Frames of the video at `path`, scaled to `size` (w, h), asked for by time (non-decreasing).

    A thread decodes ahead into a small queue; with `loop` it starts the file again at its end, each
    pass's timestamps offset by the previous passes' length, so the stream of frames the reader sees is
    endless and monotonic. A request for an earlier time than the last one starts the file afresh.
    `raw` False: every frame through swscale to RGB at `size` (the CPU path, whatever the source).
    `pin`: I420 frames land in pinned memory (the decoder thread's one copy; the upload is then async)."""

    def __init__(self, path: str | Path, size: tuple[int, int], *, loop: bool = False, raw: bool = True,
                 pin: bool = False, start: bool = True):
        self.path = check_file(path, "picture")
        self.size = (int(size[0]), int(size[1]))
        self.loop = loop
        self.raw = raw
        self.pin = pin and torch.cuda.is_available()
        self.decoded = 0  # frames the decoder has converted (tests read it)
        self.wait_s = 0.0  # seconds frame_at has waited for the decoder (--timings)
        self._thread: threading.Thread | None = None
        self._closed = False
        w, h, _ = probe_picture(self.path)
        lo, hi = READ_AHEAD_FRAMES
        self.read_ahead = max(lo, min(hi, READ_AHEAD_BYTES // (w * h * 3 // 2)))
        if start:
            self._start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        """Start decoding ahead now (frame_at starts it too), e.g. a scene before the video shows."""
        if self._thread is None and not self._closed:
            self._start()

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=self.read_ahead)
        self._current: _Frame | None = None
        self._next: _Frame | BaseException | None = None
        self._ended = False
        self.index = -1  # of the frame last returned, counting from the first pass's first frame
        self._thread = threading.Thread(target=self._decode, args=(self._stop, self._queue),
                                        name=f"lipstream-video-{self.path.name}", daemon=True)
        self._thread.start()

    @staticmethod
    def _put(stop: threading.Event, q: queue.Queue, item) -> bool:
        """Hand `item` to the reader; False once the reader has stopped this decoder."""
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _decode(self, stop: threading.Event, q: queue.Queue) -> None:
        w, h = self.size
        offset = 0.0
        try:
            while True:
                t0 = last = step = None
                with open_input(self.path) as container:
                    stream = container.streams.video[0]
                    stream.thread_type = "AUTO"
                    rate = float(stream.average_rate) if stream.average_rate else 25.0
                    pending: _Frame | None = None
                    for frame in container.decode(stream):
                        if stop.is_set():
                            return
                        if frame.time is None:
                            continue
                        t = float(frame.time)
                        if t0 is None:
                            t0 = t
                        if last is not None and t <= last:
                            continue  # a repeated or out-of-order timestamp: keep the stream monotonic
                        if last is not None:
                            step = t - last
                        last = t
                        matrix = _device_path(frame) if self.raw else None
                        if matrix:
                            picture = _i420(frame, self.pin)
                        else:
                            picture = SourceFrame(frame.to_ndarray(format="rgb24", width=w, height=h,
                                                                   interpolation="AREA"), "rgb")
                        self.decoded += 1
                        if pending is not None:
                            pending.end = offset + t - t0
                            if not self._put(stop, q, pending):
                                return
                        pending = _Frame(offset + t - t0, None, picture)
                if pending is None:
                    raise InputError(self.path, "a video with no frame that can be decoded")
                tail = step or 1.0 / rate
                if not self.loop:
                    self._put(stop, q, pending)  # end None: held
                    self._put(stop, q, None)
                    return
                pending.end = offset + last - t0 + tail
                offset = pending.end
                if not self._put(stop, q, pending):
                    return
        except BaseException as e:  # the reader raises it
            if isinstance(e, (av.error.FFmpegError, OSError)):
                e = InputError(self.path, f"cannot be decoded ({e})")
            self._put(stop, q, e)

    def _pull(self) -> _Frame | None:
        t = time.perf_counter()
        item = self._queue.get()
        self.wait_s += time.perf_counter() - t
        if isinstance(item, BaseException):
            raise item
        return item

    def frame_at(self, t: float) -> SourceFrame:
        """The frame shown at `t` seconds since the span's start (t < 0: the first). The same object
        comes back while the frame does not change (`index` counts the frames returned)."""
        if self._closed:
            raise RuntimeError(f"{self.path}: frame_at after close")
        self.start()
        if self._current is not None and self._current.start > 0 and t + EPS < self._current.start:
            self._halt()
            self._start()
        if self._current is None:
            self._current = self._pull()
            self.index = 0
            if self._current is None:
                raise InputError(self.path, "a video with no frame that can be decoded")
        while self._current.end is not None and self._current.end <= t + EPS:
            nxt = self._pull()
            if nxt is None:  # held: the frame before stays
                self._current.end = None
                break
            self._current = nxt
            self.index += 1
        return self._current.picture

    def close(self) -> None:
        """Stop the decoder thread for good (the file closes with it)."""
        self._closed = True
        self._halt()

    def _halt(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
