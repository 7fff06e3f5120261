"""The GPU core benchmark's pieces (benchmarks/gpu_core.py):
the generated 1080p anchor, its frame requests, the core's frames per second, the face boxes' PSNR
against the reference engine, and the options and report header every such script has."""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from lipstream.avatar import compile_avatar, load_avatar, ping_pong
from lipstream.engine import FrameEngine, FrameRequest, ReferenceEngine
from lipstream.fixtures.avatar import action_loop

BATCH = 32


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def common_arguments(ap: argparse.ArgumentParser, budget: float) -> argparse.ArgumentParser:
    """The options every GPU core script takes."""
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--track", type=Path, help="the face track of the bench loop (JSON, as compile --save-track writes it)")
    ap.add_argument("--budget", type=float, default=budget, help="seconds; optional steps are skipped past it")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny networks: check the script, measure nothing")
    return ap


def run_header(smoke: bool) -> dict:
    return {"date": time.strftime("%Y-%m-%d"), "device": "cpu" if smoke else torch.cuda.get_device_name(0),
            "commit": os.environ.get("LIPSTREAM_COMMIT", "unknown"), "torch": torch.__version__,
            "cpus": os.cpu_count(), "command": " ".join(sys.argv)}


def bench_avatar(m, work: Path, track: Path | None) -> Path:
    """The 1080p anchor loop, compiled (with a precomputed face track when given): its folder."""
    loop = work / "anchor.mp4"
    action_loop(loop, width=1920, height=1080, seconds=10.0, fps=25, seed=0)  # what the track file follows
    compile_avatar(loop, work / "avatars", m.vae, m.fingerprints["vae"], track_file=track, force=True,
                   progress=False)
    return work / "avatars" / "anchor"


def engine_options(spec: str) -> dict:
    """`upsample:rows[:row[:stats]]` (for example `phases:mask:6:near`) -> EngineOptions fields."""
    upsample, rows, *rest = spec.split(":")
    options = {"upsample": upsample, "decode_rows": rows}
    if rest:
        options["decode_row"] = int(rest[0])
    if len(rest) > 1:
        options["decode_stats"] = rest[1]
    return options


def requests_for(engine: FrameEngine, avatar_dir: Path, frames: int) -> list[FrameRequest]:
    engine.clear_avatars()
    index = engine.add_avatar(load_avatar(avatar_dir, engine.device))
    n = engine.avatars[index].num_frames
    windows = torch.randn(frames, 50, 384, device=engine.device, generator=torch.Generator(engine.device).manual_seed(0))
    return [FrameRequest(index, ping_pong(i, n), windows[i]) for i in range(frames)]


def core_fps(engine: FrameEngine, avatar_dir: Path, frames: int = 512, repeats: int = 3) -> tuple[float, list[float]]:
    """(startup s: compile + capture + first batch, [fps per repeat])."""
    t = time.perf_counter()
    requests = requests_for(engine, avatar_dir, frames)
    engine.warm_up()
    engine.render(requests[:BATCH])
    sync()
    startup = time.perf_counter() - t
    fps = []
    for _ in range(repeats):
        t = time.perf_counter()
        for start in range(0, frames, BATCH):
            engine.render(requests[start:start + BATCH])
        sync()
        fps.append(frames / (time.perf_counter() - t))
    return startup, fps


def box_psnr(engine: FrameEngine, reference: ReferenceEngine, avatar_dir: Path, frames: int = 64) -> dict:
    """Luma PSNR inside the face boxes, engine vs the reference engine, on the same requests."""
    req = requests_for(engine, avatar_dir, frames)
    fast = torch.cat([engine.render(req[s:s + BATCH]).clone() for s in range(0, frames, BATCH)])
    ref_req = requests_for(reference, avatar_dir, frames)
    ref = torch.cat([reference.render(ref_req[s:s + 16]) for s in range(0, frames, 16)])
    avatar = engine.avatars[0]
    h = avatar.size[1]
    values = []
    for i, r in enumerate(req):
        x1, y1, x2, y2 = avatar.boxes[r.frame].tolist()
        d = fast[i, :h][y1:y2, x1:x2].double() - ref[i, :h][y1:y2, x1:x2].double()
        values.append(10 * math.log10(255 ** 2 / max(float((d ** 2).mean()), 1e-10)))
    return {"min": min(values), "mean": statistics.fmean(values)}


def peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
