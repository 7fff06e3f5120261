"""Avatar compile and load timings for a 10 s 1080p action loop.

  python benchmarks/avatar_bench.py track --out DIR     # CPU: face tracking per frame on ONE core,
                                                        # and writes DIR/anchor.track.json
  python benchmarks/avatar_bench.py compile --track DIR/anchor.track.json --out DIR
                                                        # GPU: the rest of compiling (full-size VAE,
                                                        # fp16) and loading the avatar, from that track

The loop is the deterministic fixture (astronaut, seed 0), so a track made on one machine fits
the same loop generated on another.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import cv2  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from lipstream.fixtures.avatar import action_loop  # noqa: E402

SECONDS, FPS, WIDTH, HEIGHT = 10.0, 25, 1920, 1080


def make_loop(folder: Path) -> Path:
    path = folder / "anchor.mp4"
    if not path.exists():
        t = time.perf_counter()
        action_loop(path, width=WIDTH, height=HEIGHT, seconds=SECONDS, fps=FPS, seed=0)
        print(f"fixture loop written in {time.perf_counter() - t:.1f} s", flush=True)
    return path


def bench_track(out: Path) -> dict:
    from lipstream.avatar.compile import save_track
    from lipstream.avatar.face import DlibBackend, track
    from lipstream.avatar.video import read_loop

    cv2.setNumThreads(1)
    torch.set_num_threads(1)
    path = make_loop(out)
    t = time.perf_counter()
    loop = read_loop(path)
    decode = time.perf_counter() - t
    backend = DlibBackend()
    per_frame: list[float] = []
    last = [time.perf_counter()]

    def tick(_: int) -> None:
        now = time.perf_counter()
        per_frame.append(now - last[0])
        last[0] = now

    t = time.perf_counter()
    landmarks = track(loop.luma, len(loop.frames), backend, tick)
    total = time.perf_counter() - t
    save_track(out / "anchor.track.json", landmarks, path)
    ms = sorted(1e3 * v for v in per_frame)
    return {"frames": len(loop.frames), "size": f"{loop.width}x{loop.height}", "threads": 1,
            "decode_s": decode, "track_total_s": total, "track_ms_per_frame_mean": 1e3 * total / len(ms),
            "track_ms_median": statistics.median(ms), "track_ms_p90": ms[int(0.9 * (len(ms) - 1))],
            "track_ms_max": ms[-1], "misses": int(np.isnan(landmarks).any(axis=(1, 2)).sum()),
            "cpu": os.uname().machine}


def bench_compile(out: Path, track_file: Path) -> dict:
    from lipstream.avatar import compile_avatar, load_avatar
    from lipstream.models import load_musetalk

    path = make_loop(out)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = load_musetalk(random_weights=True, size="full" if device == "cuda" else "tiny", device=device,
                      components=["vae"])
    report: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "runs": []}
    for run in range(2):  # the first run includes cuDNN autotuning and allocator warm-up
        t = time.perf_counter()
        r = compile_avatar(path, out / "avatars", m.vae, m.fingerprints["vae"], track_file=track_file, force=True,
                           progress=False)
        total = time.perf_counter() - t
        report["runs"].append({"total_s": total, "without_track_s": total - r.timings["track"], **r.timings})
        print(f"compile run {run}: {total:.2f} s {r.timings}", flush=True)
    for run in range(3):
        t = time.perf_counter()
        avatar = load_avatar(out / "avatars" / "anchor", device, vae_fingerprint=m.fingerprints["vae"])
        load = time.perf_counter() - t
        report.setdefault("load_s", []).append(load)
        print(f"load run {run}: {load:.3f} s {avatar.timings}", flush=True)
    folder = out / "avatars" / "anchor"
    report["cache_bytes"] = {p.name: p.stat().st_size for p in folder.iterdir()}
    report["frames"] = avatar.num_frames
    report["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0
    return report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["track", "compile"])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--track", type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report = bench_track(args.out) if args.what == "track" else bench_compile(args.out, args.track)
    report["date"] = time.strftime("%Y-%m-%d")
    (args.out / f"avatar_{args.what}.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
