"""`lipstream compile`: action loops -> resident-ready avatar caches (everything not audio-dependent)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import lipstream
from lipstream.avatar import boxes as box_rule
from lipstream.avatar.cache import FORMAT_VERSION, META, AvatarWriter
from lipstream.avatar.face import fill_gaps, smooth
from lipstream.avatar.latents import encode_latents, face_crop, warm_vae_encoder
from lipstream.avatar.masks import lower_face_mask
from lipstream.avatar.trackers import Tracker
from lipstream.avatar.video import Loop, LoopsAhead, expand_inputs, read_loop
from lipstream.errors import InputError, LipStreamError
from lipstream.media.rates import as_fps
from lipstream.models.checkpoint import file_sha256


@dataclass(frozen=True)
class CompileOptions:
    """Everything besides the input and the VAE that changes the cache (part of its key)."""

    extra_margin: int = box_rule.EXTRA_MARGIN
    bbox_shift: int = 0
    smoothing: float = 1.5  # Gaussian sigma over time, in frames
    fps: str | None = None  # override the loop's frame rate ("25", "30000/1001")


@dataclass
class CompileResult:
    name: str
    source: Path
    status: str  # "compiled" | "skipped" | "failed"
    path: Path | None = None
    frames: int = 0
    size: tuple[int, int] = (0, 0)
    fps: str = ""
    face: tuple[int, int] = (0, 0)  # median box size
    seconds: float = 0.0
    message: str = ""
    timings: dict[str, float] = field(default_factory=dict)


def cache_key(source: Path, options: CompileOptions, vae_fingerprint: str, track_hash: str | None,
              tracker: str | None) -> dict:
    return {"format": FORMAT_VERSION, "source_sha256": file_sha256(source), "options": asdict(options),
            "vae": vae_fingerprint, "track_sha256": track_hash, "tracker": tracker}


def is_current(dest: Path, key: dict) -> bool:
    try:
        return json.loads((dest / META).read_text()).get("key") == key
    except (OSError, json.JSONDecodeError):
        return False


def load_track(path: Path, frames: int, width: int, height: int) -> np.ndarray:
    """Landmarks [frames, 68, 2] from a --track JSON: {"landmarks": [...]} or {"boxes": [...]}, per frame or one."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(path, f"not a readable track file ({e})") from None
    if "landmarks" in data:
        arr = np.asarray(data["landmarks"], dtype=np.float32)
        if arr.ndim == 2:
            arr = arr[None]
        if arr.shape[1:] != (68, 2):
            raise InputError(path, f"landmarks must be [frames, 68, 2], got {list(arr.shape)}")
    elif "boxes" in data:
        boxes = np.asarray(data["boxes"], dtype=np.float32).reshape(-1, 4)
        if ((boxes[:, 2] <= boxes[:, 0]) | (boxes[:, 3] <= boxes[:, 1])).any():
            raise InputError(path, "every box must be [x1, y1, x2, y2] with x2 > x1 and y2 > y1")
        arr = box_rule.template_landmarks(boxes)
    else:
        raise InputError(path, 'a track file needs "landmarks" ([frames][68][x, y]) or "boxes" ([frames][x1, y1, x2, y2])')
    if len(arr) == 1:
        arr = np.repeat(arr, frames, axis=0)
    if len(arr) != frames:
        raise InputError(path, f"has {len(arr)} entries, the loop has {frames} frames")
    if not np.isfinite(arr).all() or (arr[..., 0] < -width).any() or (arr[..., 1] < -height).any() \
            or (arr[..., 0] > 2 * width).any() or (arr[..., 1] > 2 * height).any():
        raise InputError(path, "has coordinates far outside the frame")
    return arr


def save_track(path: Path, landmarks: np.ndarray, source: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"source": source.name, "frames": len(landmarks),
                                "landmarks": np.round(landmarks, 2).tolist()}))


def compile_avatar(source: Path, avatars_dir: Path, vae, vae_fingerprint: str, *,
                   options: CompileOptions = CompileOptions(), track_file: Path | None = None,
                   save_track_dir: Path | None = None, tracker: Tracker | None = None,
                   force: bool = False, progress: bool = True, vae_random: str | None = None,
                   loops: LoopsAhead | None = None) -> CompileResult:
    """Compile one action loop into avatars_dir/<file stem>; skipped when an identical cache exists.

    `vae_random` names the random preset ("tiny", "full") when the VAE is seeded random weights:
    recorded so that a render with --random-weights can build the same networks by itself. `tracker`
    finds the faces (avatar/trackers.py) unless `track_file` gives them; `loops` may have decoded the source
    ahead (with the same frame rate override as `options`).
    """
    t0 = time.perf_counter()
    source = Path(source)
    name = source.stem
    dest = Path(avatars_dir) / name
    result = CompileResult(name, source, "compiled", dest)
    if not source.exists():
        raise InputError(source, "no such video or image")
    if track_file is not None and not Path(track_file).is_file():
        raise InputError(track_file, "no such track file")
    track_hash = file_sha256(track_file) if track_file else None
    tracker_name = "track-file" if track_file else getattr(tracker, "name", None)
    key = cache_key(source, options, vae_fingerprint, track_hash, tracker_name) if source.is_file() else {}
    if not force and is_current(dest, key):
        meta = json.loads((dest / META).read_text())
        result.status, result.frames, result.size = "skipped", meta["frames"], (meta["width"], meta["height"])
        result.fps, result.face, result.message = meta["fps"], tuple(meta["face_box_median"]), "unchanged"
        return result
    timings = result.timings

    fps = as_fps(options.fps) if options.fps else None
    loop = loops.take(source) if loops is not None else read_loop(source, fps)
    n = len(loop.frames)
    timings["decode"] = time.perf_counter() - t0
    with AvatarWriter(dest) as writer:
        writer.start_frames(loop.frames, loop.width, loop.height, loop.fps)  # encodes while we work

        t = time.perf_counter()
        landmarks = _landmarks(loop, source, name, track_file, save_track_dir, tracker, progress, result)
        landmarks = smooth(fill_gaps(landmarks), options.smoothing)
        timings["track"] = time.perf_counter() - t

        t = time.perf_counter()
        boxes = box_rule.face_boxes(landmarks, loop.width, loop.height, extra_margin=options.extra_margin,
                                    bbox_shift=options.bbox_shift)
        sizes = box_rule.box_sizes(boxes)
        small = int(np.argmin(sizes.min(axis=1)))
        if sizes[small].min() < box_rule.MIN_FACE:
            raise InputError(source, f"face too small: {sizes[small][0]}x{sizes[small][1]} px in frame {small} "
                                     f"(need at least {box_rule.MIN_FACE} px a side); use a closer shot or a "
                                     "larger video")

        def prepare(i: int) -> tuple[np.ndarray, np.ndarray]:
            crop = face_crop(loop.frames[i], boxes[i], loop.width, loop.height, loop.matrix)
            return crop, lower_face_mask(landmarks[i], boxes[i])

        warming = None
        if next(vae.parameters()).device.type == "cuda":  # the GPU is idle while the CPU cuts the crops
            warming = threading.Thread(target=quietly, args=(warm_vae_encoder, vae), name="lipstream-warm-vae",
                                       daemon=True)
            warming.start()
        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:  # OpenCV releases the GIL
            crops, masks = (np.stack(x) for x in zip(*pool.map(prepare, range(n))))
        timings["masks_crops"] = time.perf_counter() - t

        t = time.perf_counter()
        if warming is not None:
            warming.join()
        latents = encode_latents(crops, vae).to("cpu", torch.float16)
        timings["latents"] = time.perf_counter() - t

        t = time.perf_counter()
        writer.wait_frames()  # the lossless frame encode, begun at the decode: what it adds past the latents
        timings["write_wait"] = time.perf_counter() - t
        result.frames, result.size, result.fps = n, (loop.width, loop.height), str(loop.fps)
        result.face = tuple(int(v) for v in np.median(sizes, axis=0))
        meta = _meta(name, source, loop, key, options, vae, vae_fingerprint, result, tracker_name, vae_random)
        tensors = {"latents": latents, "boxes": torch.from_numpy(boxes), "masks": torch.from_numpy(masks),
                   "landmarks": torch.from_numpy(np.ascontiguousarray(landmarks, dtype=np.float32))}
        writer.finish(meta, tensors)
    result.seconds = time.perf_counter() - t0
    return result


def quietly(work: Callable[..., object], *args) -> None:
    """A warm-up on a thread: a failure there is left for the real call to raise, in one line."""
    try:
        work(*args)
    except BaseException:  # noqa: BLE001
        pass


def _landmarks(loop: Loop, source: Path, name: str, track_file: Path | None, save_track_dir: Path | None,
               tracker: Tracker | None, progress: bool, result: CompileResult) -> np.ndarray:
    """Landmarks from the track file, or tracked (optionally saved for reuse)."""
    n = len(loop.frames)
    if track_file:
        return load_track(track_file, n, loop.width, loop.height)
    if tracker is None:
        raise LipStreamError("compile needs a face tracker or a track file (avatar/trackers.py)")
    with tqdm(total=n, desc=f"{result.name}: tracking", unit="frame", disable=not progress, leave=False) as bar:
        landmarks = tracker.landmarks(loop, bar.update)
    found = int((~np.isnan(landmarks).any(axis=(1, 2))).sum())
    if found == 0:
        raise InputError(source, "no face found in any frame")
    result.message = f"face found in {found}/{n} frames" if found < n else ""
    if save_track_dir:
        save_track(Path(save_track_dir) / f"{name}.track.json", landmarks, source)
    return landmarks


def _meta(name: str, source: Path, loop: Loop, key: dict, options: CompileOptions, vae, vae_fingerprint: str,
          result: CompileResult, tracker: str, vae_random: str | None) -> dict:
    return {
        "format": FORMAT_VERSION,
        "name": name,
        "lipstream": lipstream.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "source": {"file": source.name, "sha256": key["source_sha256"], "bytes": source.stat().st_size},
        "key": key,
        "fps": str(loop.fps),
        "width": loop.width,
        "height": loop.height,
        "frames": len(loop.frames),
        "still": loop.still,
        "colour_matrix": loop.matrix,
        "loop": "ping-pong",
        "face_box_median": list(result.face),
        "tracker": tracker,
        "parameters": asdict(options),
        "latents": "VAE latent mean x 0.18215; [masked lower half, reference] = 8 channels",
        "vae": {"fingerprint": vae_fingerprint, "dtype": str(next(vae.parameters()).dtype).removeprefix("torch."),
                "random": vae_random},
        "timings_s": {k: round(v, 4) for k, v in result.timings.items()},
    }


def compile_many(inputs: list[Path], avatars_dir: Path, vae, vae_fingerprint: str, **kwargs) -> list[CompileResult]:
    """Compile each input; one bad input is reported in its result, the others still compile. Each next
    input decodes while the one before it compiles (`loops`, or begun here)."""
    sources = expand_inputs(inputs)
    track = kwargs.pop("track", None)
    if track is not None and Path(track).is_file() and len(sources) > 1:
        raise LipStreamError("--track FILE applies to one input; for several, pass a folder of <name>.track.json")
    options = kwargs.get("options", CompileOptions())
    loops = kwargs.pop("loops", None)
    owned = loops is None
    if owned:
        loops = LoopsAhead(sources, as_fps(options.fps) if options.fps else None)
    results, seen = [], set()
    try:
        for source in sources:
            if source.stem in seen:
                results.append(CompileResult(source.stem, source, "failed", message="another input has the same name"))
                continue
            seen.add(source.stem)
            track_file = None
            if track is not None:
                track_file = Path(track) if Path(track).is_file() else Path(track) / f"{source.stem}.track.json"
            try:
                results.append(compile_avatar(source, avatars_dir, vae, vae_fingerprint, track_file=track_file,
                                              loops=loops, **kwargs))
            except LipStreamError as e:
                results.append(CompileResult(source.stem, source, "failed", message=str(e)))
    finally:
        if owned:
            loops.close()
    return results
