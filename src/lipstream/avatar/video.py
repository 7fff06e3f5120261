"""Read an action loop (a video, or a still image) into I420 frames with PyAV."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from lipstream.errors import InputError
from lipstream.files import check_file
from lipstream.media.demux import open_input
from lipstream.media.pixels import default_matrix

MAX_SIDE = 4096  # pixels; 4K DCI. Larger frames are refused rather than half-processed
MAX_BYTES = 8 * 2**30  # I420 bytes of all frames held at once (~1700 frames of 1080p)
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff"}
VIDEO_SUFFIXES = {".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v", ".mpg", ".mpeg", ".ts", ".flv", ".gif"}
DEFAULT_STILL_FPS = Fraction(25)
AHEAD_BYTES = 2 * 2**30  # the next loop is decoded during this one's compile only while this one is at most
# this big: two loops in memory at once, never two of the largest


@dataclass
class Loop:
    """Decoded frames of one action loop, in the decoder's own planar YUV 4:2:0 layout."""

    frames: list[np.ndarray]  # each [H * 3 / 2, W] uint8: Y rows, then U rows, then V rows
    width: int
    height: int
    fps: Fraction
    matrix: str  # "bt601" | "bt709": how these YUV values map to RGB
    still: bool

    def luma(self, i: int) -> np.ndarray:
        """[H, W] Y plane of frame i: the grey image face tracking looks at."""
        return self.frames[i][: self.height]


def expand_inputs(inputs: list[Path]) -> list[Path]:
    """Files as given; folders become their video and image files, sorted."""
    out: list[Path] = []
    for p in map(Path, inputs):
        if p.is_dir():
            try:
                files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in VIDEO_SUFFIXES | IMAGE_SUFFIXES)
            except OSError as e:
                raise InputError(p, f"cannot read folder ({e.strerror})") from None
            if not files:
                raise InputError(p, "folder holds no videos or images")
            out.extend(files)
        else:
            out.append(p)
    return out


def read_loop(path: str | Path, fps: float | Fraction | None = None) -> Loop:
    """All frames of a video or a still image as I420; odd sizes lose their last row/column."""
    path = check_file(path, "video or image")
    if path.stat().st_size == 0:
        raise InputError(path, "is empty (0 bytes)")
    still = path.suffix.lower() in IMAGE_SUFFIXES
    try:
        container = open_input(path)
    except av.error.FFmpegError as e:
        raise InputError(path, f"not a readable video or image ({_reason(e)})") from None
    frames: list[np.ndarray] = []
    with container:
        stream = next((s for s in container.streams if s.type == "video"), None)
        if stream is None:
            raise InputError(path, "has no video stream")
        stream.thread_type = "AUTO"
        ctx = stream.codec_context
        width, height = ctx.width & ~1, ctx.height & ~1
        if max(ctx.width, ctx.height) > MAX_SIDE:
            raise InputError(path, f"frame size {ctx.width}x{ctx.height} is too large (at most {MAX_SIDE} "
                                   "pixels a side); scale it down first")
        if width < 2 or height < 2:
            raise InputError(path, f"frame size {ctx.width}x{ctx.height} is too small")
        rate = stream.average_rate or stream.guessed_rate
        matrix = default_matrix(_colorspace_name(ctx))
        try:
            for frame in container.decode(stream):
                frames.append(_i420(frame, width, height))
                if len(frames) * width * height * 3 // 2 > MAX_BYTES:
                    raise InputError(path, f"is too long to hold as a loop (over {len(frames)} frames of "
                                           f"{width}x{height}); trim it")
        except av.error.FFmpegError as e:
            if not frames:
                raise InputError(path, f"corrupt video data ({_reason(e)})") from None
            raise InputError(path, f"corrupt video data after frame {len(frames)} ({_reason(e)})") from None
    if not frames:
        raise InputError(path, "contains no video frames")
    still = still or len(frames) == 1
    if fps is not None:
        loop_fps = Fraction(fps).limit_denominator(1_000_000)
    elif still or not rate:
        loop_fps = DEFAULT_STILL_FPS
    else:
        loop_fps = Fraction(rate)
    return Loop(frames, width, height, loop_fps, matrix, still)


class LoopsAhead:
    """Decodes `sources` in order on a thread, one ahead of their use: the first while the command imports
    torch and loads its networks (~0.8 s of a 300-frame 1080p loop off the process wall), each next one
    while the one before it compiles. A source taken out of order is decoded there and then."""

    def __init__(self, sources: list[Path], fps: float | Fraction | None = None):
        self.sources, self.fps = [Path(s) for s in sources], fps
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lipstream-decode")
        self._next: tuple[int, Future] | None = None
        self._begin(0)

    def _begin(self, i: int) -> None:
        self._next = (i, self._pool.submit(read_loop, self.sources[i], self.fps)) if i < len(self.sources) else None

    def take(self, source: Path) -> Loop:
        """The loop of `source`, raising what its decode raised (InputError for a bad file)."""
        source = Path(source)
        ahead, self._next = self._next, None
        if ahead is not None and self.sources[ahead[0]] == source:
            i, decoding = ahead
        else:  # out of order (an input passed over): decoded here and now
            if ahead is not None:
                ahead[1].cancel()
            i, decoding = (self.sources.index(source) if source in self.sources else len(self.sources)), None
        try:
            loop = decoding.result() if decoding is not None else read_loop(source, self.fps)
        except BaseException:
            self._begin(i + 1)
            raise
        if loop_bytes(loop) <= AHEAD_BYTES:  # else the next one is decoded when taken
            self._begin(i + 1)
        return loop

    def close(self) -> None:
        """Drop a decode not taken (the thread finishes the file it is on; its frames are freed)."""
        if self._next is not None:
            self._next[1].cancel()
            self._next = None
        self._pool.shutdown(wait=False, cancel_futures=True)


def loop_bytes(loop: Loop) -> int:
    return sum(f.nbytes for f in loop.frames)


def _i420(frame: av.VideoFrame, width: int, height: int) -> np.ndarray:
    if frame.format.name != "yuv420p" or frame.width != width or frame.height != height:
        if frame.width != width or frame.height != height:  # odd size: crop to even in RGB first
            rgb = frame.to_ndarray(format="rgb24")[:height, :width]
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
        frame = frame.reformat(format="yuv420p")
    return frame.to_ndarray()


def _colorspace_name(ctx) -> str | None:
    value = getattr(ctx, "colorspace", None)
    if value is None:
        return None
    name = getattr(value, "name", None) or str(value)
    return {"1": "bt709", "5": "bt601", "6": "bt601"}.get(name, name) if name not in ("2", "UNSPECIFIED") else None


def _reason(e: BaseException) -> str:
    return getattr(e, "strerror", None) or str(e) or type(e).__name__
