"""The compiled avatar on disk, and resident in memory.

One folder per avatar:
  avatar.json         format version, source hash, fps, frame size and count, parameters, VAE fingerprint
  avatar.safetensors  latents [N, 8, 32, 32], boxes [N, 4] int32, masks [N, 256, 256] uint8,
                      landmarks [N, 68, 2] float32
  frames.mp4          the N source frames, lossless H.264 (qp 0, yuv420p): exact, ~10x smaller than
                      raw, decoded by FFmpeg's threads at load
Folders are built under a temporary name and renamed into place, so a failed compile leaves
nothing behind and a reader never sees half an avatar. No pickle anywhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch
from safetensors.torch import load_file, save_file

from lipstream.avatar.folders import META
from lipstream.errors import InputError, LipStreamError

FORMAT_VERSION = 1
TENSORS = "avatar.safetensors"
FRAMES = "frames.mp4"


@dataclass
class Avatar:
    """A compiled action loop. Tensors live on one device; frames are I420 [N, H*3/2, W] uint8."""

    name: str
    path: Path
    meta: dict
    latents: torch.Tensor
    boxes: torch.Tensor
    masks: torch.Tensor
    landmarks: torch.Tensor
    frames: torch.Tensor | None = None
    timings: dict[str, float] = field(default_factory=dict)
    loader: "FrameLoader | None" = None  # frames still arriving in the background

    def wait_frames(self, count: int | None = None) -> None:
        """Block until frames [0, count) (default: all) are resident; raises a failed load's error."""
        if self.loader is not None:
            self.loader.wait(self.num_frames if count is None else count)
            if self.loader.complete:
                self.loader = None

    @property
    def fps(self) -> Fraction:
        return Fraction(self.meta["fps"])

    @property
    def size(self) -> tuple[int, int]:
        return self.meta["width"], self.meta["height"]

    @property
    def num_frames(self) -> int:
        return self.meta["frames"]

    @property
    def cycle(self) -> int:
        return cycle_length(self.num_frames)

    def frame_index(self, step: torch.Tensor | int) -> torch.Tensor | int:
        return ping_pong(step, self.num_frames)


def cycle_length(frames: int) -> int:
    """Steps before a ping-pong loop (0 1 .. N-1 N-2 .. 1) repeats."""
    return max(1, 2 * frames - 2)


def ping_pong(step: torch.Tensor | int, frames: int) -> torch.Tensor | int:
    """Frame index of a step in the forward-then-backward loop, by arithmetic: no frame stored twice."""
    if frames == 1:
        return step * 0
    k = step % cycle_length(frames)
    if isinstance(k, torch.Tensor):
        return torch.where(k >= frames, 2 * (frames - 1) - k, k)
    return 2 * (frames - 1) - k if k >= frames else k


class AvatarWriter:
    """Builds an avatar folder beside `dest` and renames it into place when complete.

    The lossless frame encode (the slowest part of writing) starts in a background thread as soon
    as the frames are decoded, overlapping tracking, masks and latents; PyAV releases the GIL
    while x264 works. Use as a context manager: on any exception the folder is removed, as are
    the folders above it that this writer created (`-o out/avatars` that did not exist) when they
    are empty again, and an older avatar at `dest` stays as it was.
    """

    def __init__(self, dest: Path):
        self.dest = Path(dest)
        self._made = _make_parents(self.dest.parent)  # folders created here, deepest first
        tmp = None
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{self.dest.name}.", suffix=".part", dir=self.dest.parent))
            umask = os.umask(0)
            os.umask(umask)
            tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; a cache is as shareable as any folder
        except BaseException:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            self._remove_made()
            raise
        self.tmp = tmp
        self._finished = False
        self._frames: Future | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="avatar-frames")

    def __enter__(self) -> "AvatarWriter":
        return self

    def start_frames(self, frames: list[np.ndarray], width: int, height: int, fps: Fraction) -> None:
        self._frames = self._pool.submit(write_frames, self.tmp / FRAMES, frames, width, height, fps)

    def wait_frames(self) -> None:
        """Until the frame encode has finished (raising what it raised)."""
        if self._frames is None:
            raise RuntimeError("start_frames() was not called")
        self._frames.result()

    def finish(self, meta: dict, tensors: dict[str, torch.Tensor]) -> Path:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(self.tmp / TENSORS),
                  metadata={"format": str(FORMAT_VERSION)})
        if self._frames is None:
            raise RuntimeError("start_frames() was not called")
        self._frames.result()
        (self.tmp / META).write_text(json.dumps(meta, indent=2))  # last: its presence marks a complete avatar
        old = None
        if self.dest.exists():
            old = self.dest.with_name(f".{self.dest.name}.old-{time.time_ns()}")
            self.dest.rename(old)
        self.tmp.rename(self.dest)
        self._finished = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.dest

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._frames is not None and exc_type is not None:
            self._frames.cancel()
            try:
                self._frames.result()
            except BaseException:  # the encode's own failure is secondary to the one being raised
                pass
        self._pool.shutdown(wait=True)
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)
        if not self._finished:
            self._remove_made()

    def _remove_made(self) -> None:
        """Remove the folders this writer created, deepest first, while they are empty."""
        for folder in self._made:
            try:
                folder.rmdir()  # fails on a folder that holds anything (another avatar, another writer's)
            except OSError:
                break


def _make_parents(folder: Path) -> list[Path]:
    """mkdir -p `folder`; returns the folders it created, deepest first (none that already existed)."""
    missing = []
    for p in (folder, *folder.parents):
        if p.is_dir():
            break
        missing.append(p)
    made = []
    try:
        for p in reversed(missing):
            try:
                p.mkdir()
            except FileExistsError:  # made meanwhile by someone else: theirs, not ours to remove
                if not p.is_dir():
                    raise
                continue
            made.append(p)
    except BaseException:
        for p in reversed(made):
            with contextlib.suppress(OSError):
                p.rmdir()
        raise
    return made[::-1]


def write_frames(path: Path, frames: list[np.ndarray], width: int, height: int, fps: Fraction) -> None:
    """Lossless H.264 (qp 0) of I420 frames: decodes back bit-exact."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=fps, options={"qp": "0", "preset": "ultrafast"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.thread_count = 0
        for planes in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(planes, format="yuv420p")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)


class FrameLoader:
    """Decodes an avatar's frames into one tensor on `device`, in order, optionally in a thread.

    In the background the first frames are ready within milliseconds, so rendering starts while
    the rest of the loop decodes. On CUDA each frame goes through a small ring of pinned staging
    buffers on the loader's own stream, so the upload overlaps decoding and no GB-sized pinned
    buffer is allocated; `wait` makes the caller's stream wait for those copies.
    """

    def __init__(self, path: Path, count: int, width: int, height: int, device: str | torch.device = "cpu",
                 *, background: bool = True):
        self.path, self.count = path, count
        self.device = torch.device(device)
        self.frames = torch.empty((count, height * 3 // 2, width), dtype=torch.uint8, device=self.device)
        self.ready = 0
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._cond = threading.Condition()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # `frames` is allocated
        if background:
            threading.Thread(target=self._run, name=f"avatar-frames-{path.parent.name}", daemon=True).start()
        else:
            self._run()

    @property
    def complete(self) -> bool:
        return self.ready >= self.count or self.error is not None

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self._decode()
            if self.ready != self.count:
                raise LipStreamError(f"{self.path}: holds {self.ready} frames, avatar.json says {self.count}; "
                                     "compile it again")
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            with self._cond:
                self.error = e
                self._cond.notify_all()
        self.seconds = time.perf_counter() - t0

    def _decode(self) -> None:
        shape = tuple(self.frames.shape[1:])
        ring: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        if self._stream is not None:
            ring = [(torch.empty(shape, dtype=torch.uint8, pin_memory=True), torch.cuda.Event()) for _ in range(4)]
        with av.open(str(self.path)) as container, \
                (torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()):
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            stream.thread_count = 0
            n = 0
            for frame in container.decode(stream):
                if n == self.count:
                    break
                planes = frame.to_ndarray()
                if ring:
                    staging, done = ring[n % len(ring)]
                    done.synchronize()  # the copy that last used this buffer has finished
                    staging.numpy()[:] = planes
                    self.frames[n].copy_(staging, non_blocking=True)
                    done.record()
                else:
                    self.frames[n].numpy()[:] = planes
                n += 1
                if n % 8 == 0 or n == self.count:
                    with self._cond:
                        self.ready = n
                        self._cond.notify_all()
            with self._cond:
                self.ready = n
                self._cond.notify_all()

    def wait(self, count: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.ready >= min(count, self.count) or self.error is not None)
        if self.error is not None:
            raise self.error
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)


def read_meta(folder: Path) -> dict:
    meta_path = Path(folder) / META
    if not meta_path.is_file():
        raise InputError(folder, "is not a compiled avatar (no avatar.json); run `lipstream compile` first")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(meta_path, f"unreadable ({e}); compile the avatar again") from None
    if meta.get("format") != FORMAT_VERSION:
        raise InputError(folder, f"was compiled in cache format {meta.get('format')}, this LipStream reads "
                                 f"format {FORMAT_VERSION}; compile it again (lipstream compile --force)")
    return meta


def load_avatar(folder: str | Path, device: str | torch.device = "cpu", *, vae_fingerprint: str | None = None,
                with_frames: bool = True, dtype: torch.dtype | None = None, background: bool = False) -> Avatar:
    """An avatar resident on `device`, ready to render.

    `background=True` returns at once with the frames still decoding (Avatar.wait_frames blocks
    for the ones a caller needs).

    `vae_fingerprint` (the loaded VAE's) must match the one the latents were made with: latents
    of another VAE would decode to garbage, so such a cache is refused.
    """
    folder = Path(folder)
    t0 = time.perf_counter()
    meta = read_meta(folder)
    if vae_fingerprint is not None and meta["vae"]["fingerprint"] != vae_fingerprint:
        made_with = meta["vae"].get("random")
        hint = (f"it was made with random {made_with} weights: render with --random-weights --random-size {made_with}"
                f" (or --random-size auto), or compile it again with these weights (--force)" if made_with
                else "compile it again with these weights (--force)")
        raise InputError(folder, f"was compiled with another VAE (fingerprint {meta['vae']['fingerprint']}, "
                                 f"loaded VAE {vae_fingerprint}); {hint}")
    try:
        tensors = load_file(str(folder / TENSORS), device=str(device))
    except Exception as e:
        raise InputError(folder / TENSORS, f"unreadable ({e}); compile the avatar again") from None
    t1 = time.perf_counter()
    loader = None
    if with_frames:
        if not (folder / FRAMES).is_file():
            raise InputError(folder / FRAMES, "is missing; compile the avatar again")
        loader = FrameLoader(folder / FRAMES, meta["frames"], meta["width"], meta["height"], device,
                             background=background)
        if not background:
            loader.wait(meta["frames"])
    if torch.device(device).type == "cuda" and not background:
        torch.cuda.synchronize(device)
    latents = tensors["latents"] if dtype is None else tensors["latents"].to(dtype)
    return Avatar(meta["name"], folder, meta, latents, tensors["boxes"], tensors["masks"], tensors["landmarks"],
                  loader.frames if loader else None, {"tensors_s": t1 - t0, "frames_s": time.perf_counter() - t1},
                  loader if background else None)
