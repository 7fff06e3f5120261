"""The GPU core's frames per second and fidelity, per engine variant: the frame step alone, no encode.

Each variant is `upsample:rows[:row[:stats]]` (the engine's `upsample`, `decode_rows`, `decode_row` and
`decode_stats`), for example `plain:full`, `phases:full`, `transpose:mask:6:near`. For each: build the
engine (`compile all`, graphs, batch 32, buckets 8 and 32), time compile + capture, then the core
(windows -> UNet -> VAE decode -> blend into I420) over 512 frames three times, and the luma PSNR inside
the face boxes against the eager fp32 reference engine on 64 frames. Every variant rewrites
OUT/core_variants.json and .md, so a time limit keeps what finished; variants past `--budget` s are skipped.

    python3 benchmarks/gpu_core.py --out DIR                      # a CUDA GPU: the defaults, exact, no fusion
    python3 benchmarks/gpu_core.py --models MODELS --avatar AVATAR --out DIR   # your weights and presenter
    python3 benchmarks/gpu_core.py --smoke --out DIR              # CPU, tiny networks: checks the script

Without `--track` (the generated 1080p anchor's face track as JSON) the loop is tracked here with dlib.
docs/BENCHMARKS.md, "GPU core", holds the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lipstream.bench.core import BATCH, bench_avatar, box_psnr, common_arguments, core_fps, engine_options, run_header
from lipstream.engine import ModuleEngine, ReferenceEngine
from lipstream.engine.options import EngineOptions
from lipstream.models import load_musetalk

DEFAULT = "transpose:auto,transpose:full,plain:full"  # the defaults, the exact decode, no fusion

TARGETS = {"core_fps": 600, "psnr_db": 40}


def markdown(report: dict) -> str:
    lines = [f"# GPU core variants ({report['date']}, {report['device']}, commit {report['commit']}, torch "
             f"{report['torch']})", "",
             f"Weights: {report.get('weights', 'random')} (full size). fp16, batch 32, `compile all`, graphs; "
             "core = windows -> UNet -> VAE decode -> blend, 512 frames, no encode. "
             "PSNR: luma in the face boxes against eager fp32, 64 frames.",
             "", "| variant | core fps (3 runs) | median | PSNR min dB | PSNR mean dB | compile + capture s |",
             "|---|---|---|---|---|---|"]
    for spec, r in report["variants"].items():
        if "error" in r:
            lines.append(f"| `{spec}` | failed: {r['error'][:120]} | | | | |")
            continue
        p = r.get("psnr", {})
        lines.append(f"| `{spec}` | {', '.join(f'{v:.0f}' for v in r['fps'])} | {r['fps_median']:.0f} | "
                     f"{p.get('min', float('nan')):.1f} | {p.get('mean', float('nan')):.1f} | {r['startup_s']:.0f} |")
    lines.append(f"\nTargets: core >= {TARGETS['core_fps']} fps at PSNR >= {TARGETS['psnr_db']} dB.")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = common_arguments(argparse.ArgumentParser(), budget=540)
    ap.add_argument("--variants", default=DEFAULT, help="comma-separated upsample:rows[:row[:stats]]")
    ap.add_argument("--models", type=Path, help="real MuseTalk weights (default: full-size random ones)")
    ap.add_argument("--avatar", type=Path, help="a compiled avatar folder (default: the generated 1080p anchor)")
    args = ap.parse_args()
    device, size, compile = ("cpu", "tiny", "off") if args.smoke else ("cuda", "full", "all")
    frames = 64 if args.smoke else 512
    t_start = time.perf_counter()
    out, work = args.out, Path("/tmp/lipstream-variants")
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {**run_header(args.smoke), "weights": str(args.models or "random"), "variants": {}}

    def save() -> None:
        report["elapsed_s"] = time.perf_counter() - t_start
        (out / "core_variants.json").write_text(json.dumps(report, indent=2))
        (out / "core_variants.md").write_text(markdown(report))

    weights = {"random_weights": args.models is None, "size": size, "seed": 0, "warn": False}
    m = load_musetalk(args.models, device=device, **weights)
    avatar_dir = args.avatar or bench_avatar(m, work, args.track)
    ref_models = load_musetalk(args.models, device=device, dtype=torch.float32, **weights)
    reference = ReferenceEngine(ref_models)
    for spec in args.variants.split(","):
        if time.perf_counter() - t_start > args.budget - 100:
            report["variants"][spec] = {"error": "skipped: time budget"}
            save()
            continue
        engine = None
        try:
            t = time.perf_counter()
            engine = ModuleEngine(m, EngineOptions(batch=BATCH, inductor=compile, **engine_options(spec)))
            built = time.perf_counter() - t
            startup, fps = core_fps(engine, avatar_dir, frames, repeats=1 if args.smoke else 3)
            row = {"startup_s": built + startup, "fps": fps, "fps_median": statistics.median(fps)}
            report["variants"][spec] = row
            save()
            row["psnr"] = box_psnr(engine, reference, avatar_dir)
        except Exception as e:  # one variant failing must not lose the others
            report["variants"][spec] = {"error": f"{type(e).__name__}: {e}"}
        print(spec, report["variants"][spec], flush=True)
        save()
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
