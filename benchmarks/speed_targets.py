"""Issue 5's targets in one GPU call: startup, GPU core fps and PSNR, the monologue end to end.

1. Startup: networks built, then compile + graph capture, cold (and, at the end, warm-cache in a
   fresh process).
2. GPU core (engine.render: windows -> UNet -> VAE decode -> blend, no encode), batch 32, for the
   full decode and the mask-rows decode (`decode_rows="mask"`).
3. PSNR of each against the eager fp32 reference engine, luma of the face boxes, same requests.
4. The 775-frame 30 fps 1080p monologue end to end after a warm start: one warm-up render, then
   three timed ones per configuration; first-packet variants (2-frame first segment, a lower GIL
   switch interval).
Every step rewrites DIR/targets.json and DIR/targets.md, so a time limit keeps what finished.

Rerun (a CUDA GPU, the `lipstream` package installed, e.g. `pip install -e .`):

    python3 benchmarks/speed_targets.py --track .bench/anchor.track.json --out DIR
    python3 benchmarks/speed_targets.py --track .bench/anchor.track.json --out DIR --monologue-only \
        [--engine transpose:auto]                                 # the monologue only
    python3 benchmarks/speed_targets.py --smoke --out DIR       # CPU, tiny networks: checks the script

`--track` is a face track of the generated 1080p anchor loop (`action_loop(..., width=1920,
height=1080, seconds=10.0, fps=25, seed=0)`, deterministic); without it the loop is tracked here
with dlib, whose model must then be on the machine. The runs in docs/BENCHMARKS.md used one made
on a CPU by the retired avatar_bench.py (see "Finished studies" there); `lipstream compile
anchor.mp4 -o DIR --random-weights --save-track .bench` on that loop writes one with the same
tracker and format.
Reported in docs/BENCHMARKS.md, "Speed, fifth session (issue 5): all targets met on the H200"
(commit e779966) and "Speed, third session (issue 5): end to end and first packet met, core not"
(commits 11a42cb, 0992574); docs/results/speed_targets_*.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import torch

from lipstream.bench.core import (
    BATCH, bench_avatar, box_psnr, common_arguments, core_fps, engine_options, peak_gib, requests_for, reset_peak,
    run_header, sync)
from lipstream.engine import Engine, ReferenceEngine
from lipstream.fixtures import speech_like, write_audio
from lipstream.media import mp4
from lipstream.models import load_musetalk
from lipstream.options import EngineOptions, RenderOptions
from lipstream.render import render_program
from lipstream.script import single_scene

SMOKE = False  # --smoke: CPU, tiny networks, short runs, no compile (checks this script, measures nothing)


WARM_COMPILE = """
import sys, time, torch
from lipstream.engine import Engine
from lipstream.models import load_musetalk
from lipstream.options import EngineOptions
m = load_musetalk(random_weights=True, size="full", device="cuda", seed=0, warn=False)
t = time.perf_counter()
Engine(m, EngineOptions(batch={batch}, inductor="all", decode_rows="{rows}")).warm_up()
torch.cuda.synchronize()
print(time.perf_counter() - t)
"""


def monologue(engine: Engine, program, work: Path, repeats: int = 3, **kwargs) -> list[dict]:
    """One warm-up render (kept with keep_warmup=True: its avatars were not resident yet), then `repeats`."""
    rows = []
    keep_warmup = kwargs.pop("keep_warmup", False)
    for attempt in range(1 + repeats):  # the first is a warm-up (encoder pool, avatar graphs)
        reset_peak()
        options = RenderOptions(engine.o, fps=Fraction(30), x264_preset="ultrafast", avatars_dir=work / "avatars",
                                progress=False, **kwargs)
        r = render_program(program, work / "mono.mp4", engine.m, options, engine=engine)
        if attempt or keep_warmup:
            rows.append({"attempt": attempt, "frames": r.frames, "wall_s": r.wall_s, "fps": r.render_fps, "first_packet_s": r.first_frame_s,
                         "peak_gpu_gib": peak_gib(), **r.timings})
            print("  monologue", {k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()},
                  flush=True)
    return rows


_defaults = EngineOptions()
# The full run's two engines: the engine's defaults with the whole decode, and with the mask rows.
DEFAULT_ENGINE = (f"{_defaults.upsample}:full, {_defaults.upsample}:mask:"
                  f"{_defaults.decode_row}:{_defaults.decode_stats}")
TARGETS = {"core_fps": 600, "monologue_s": 3.1, "first_packet_s": 0.150, "psnr_db": 40}


def markdown(report: dict) -> str:
    """The report as a page: each measurement against issue 5's targets."""
    lines = [f"# Speed targets ({report['date']}, {report['device']}, commit {report['commit']}, torch "
             f"{report['torch']}, {report['cpus']} CPUs)", "",
             f"Engine `{report.get('engine', DEFAULT_ENGINE)}` (upsample:decode rows[:row:stats]). "
             "Full-size random weights, fp16, batch 32, `compile all`; monologue: 775 frames at 30 fps, 1080p, "
             "x264 ultrafast, 8 segment encoders, one warm-up render then three timed.", ""]
    for rows in ("full", "mask"):
        core, psnr = report.get(f"core_{rows}"), report.get(f"psnr_{rows}_vs_fp32_reference_db")
        if core:
            lines.append(f"- GPU core, {rows} decode: " + ", ".join(f"{v:.0f}" for v in core["fps"])
                         + f" fps (target {TARGETS['core_fps']}); startup {core['startup_s']:.1f} s")
        if psnr:
            lines.append(f"- PSNR vs eager fp32, face boxes, {rows} decode: min {psnr['min']:.1f}, mean "
                         f"{psnr['mean']:.1f} dB (target >= {TARGETS['psnr_db']})")
    if "startup_cold_s" in report:
        lines.append(f"- startup, cold Inductor cache (compile + capture): {report['startup_cold_s']:.1f} s")
    for rows in ("full", "mask"):
        warm = report.get(f"warm_compile_{rows}")
        if isinstance(warm, dict) and isinstance(warm.get("engine_s"), float):
            lines.append(f"- startup, warm Inductor cache, {rows} decode, fresh process: engine "
                         f"{warm['engine_s']:.1f} s ({warm['process_s']:.1f} s with imports and networks)")
    lines += ["", "| run | attempt | wall s | fps | first packet s | peak GPU GiB | first batch queued s | "
              "first segment submitted s |", "|---|---|---|---|---|---|---|---|"]
    for key, runs in report.items():
        if key.startswith("monologue") and isinstance(runs, list):
            for r in runs:
                lines.append(f"| {key} | {r.get('attempt', '')} | {r['wall_s']:.2f} | {r['fps']:.0f} | "
                             f"{r['first_packet_s']:.3f} | {r['peak_gpu_gib']:.2f} | "
                             f"{r.get('first_batch_queued_s', float('nan')):.3f} | "
                             f"{r.get('first_segment_submitted_s', float('nan')):.3f} |")
    lines.append(f"\nTargets: wall <= {TARGETS['monologue_s']} s, first packet <= {TARGETS['first_packet_s']} s.")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = common_arguments(argparse.ArgumentParser(), budget=520)
    ap.add_argument("--monologue-only", action="store_true",
                    help="the compiled engine's monologue only: resident avatars vs loaded per render")
    ap.add_argument("--engine", default="transpose:auto", help="--monologue-only's engine: upsample:rows[:row[:stats]]")
    args = ap.parse_args()
    global SMOKE
    SMOKE = args.smoke
    device, size, compile = ("cpu", "tiny", "off") if SMOKE else ("cuda", "full", "all")
    frames, seconds = (64, 2.0) if SMOKE else (512, 775 / 30)
    t_start = time.perf_counter()
    out, work = args.out, Path("/tmp/lipstream-targets")
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {**run_header(SMOKE), "batch": BATCH}

    def save(step: str) -> None:
        report.setdefault("elapsed_s", {})[step] = time.perf_counter() - t_start
        (out / "targets.json").write_text(json.dumps(report, indent=2))
        (out / "targets.md").write_text(markdown(report))

    def left() -> float:
        return args.budget - (time.perf_counter() - t_start)

    t = time.perf_counter()
    m = load_musetalk(random_weights=True, size=size, device=device, seed=0, warn=False)
    sync()
    report["networks_built_s"] = time.perf_counter() - t
    avatar_dir = bench_avatar(m, work, args.track)
    program = single_scene("anchor", write_audio(work / "monologue.wav", speech_like(seconds, 16000, seed=3), 16000))
    save("setup")

    if args.monologue_only:
        t = time.perf_counter()
        report["engine"] = args.engine
        engine = Engine(m, EngineOptions(batch=BATCH, inductor=compile, **engine_options(args.engine)))
        requests_for(engine, avatar_dir, BATCH)
        engine.warm_up()
        sync()
        report["startup_cold_s"] = time.perf_counter() - t
        save("startup")
        from lipstream.avatar.resident import drop_resident
        drop_resident()
        report["monologue_resident"] = monologue(engine, program, work, repeats=1 if SMOKE else 3, keep_warmup=True)
        save("monologue_resident")
        if left() > 25:
            report["monologue_loaded_per_render"] = monologue(engine, program, work, repeats=1 if SMOKE else 3,
                                                              resident=False)
            save("monologue_loaded_per_render")
        return

    engines = {}
    for rows in ("full", "mask"):
        t = time.perf_counter()
        engine = Engine(m, EngineOptions(batch=BATCH, inductor=compile, decode_rows=rows))
        built = time.perf_counter() - t
        startup, fps = core_fps(engine, avatar_dir, frames, repeats=1 if SMOKE else 3)
        report[f"core_{rows}"] = {"startup_s": built + startup, "fps": fps, "fps_median": statistics.median(fps)}
        print(f"core {rows}: {report[f'core_{rows}']}", flush=True)
        save(f"core_{rows}")
        engines[rows] = engine
        report[f"monologue_{rows}"] = monologue(engine, program, work, repeats=1 if SMOKE else 3)
        save(f"monologue_{rows}")
        if rows == "full":
            default = mp4.SEGMENT_FRAMES
            other = 4 if default[0] == 2 else 2  # the first-segment length the default is not
            mp4.SEGMENT_FRAMES = (other, *default[1:])
            report[f"monologue_full_first_segment_{other}"] = monologue(engine, program, work,
                                                                        repeats=1 if SMOKE else 3)
            mp4.SEGMENT_FRAMES = default
            save(f"first_segment_{other}")
            interval = sys.getswitchinterval()
            sys.setswitchinterval(1e-4)
            report["monologue_full_switchinterval_1e-4"] = monologue(engine, program, work, repeats=1 if SMOKE else 3)
            sys.setswitchinterval(interval)
            save("switchinterval")

    ref_models = load_musetalk(random_weights=True, size=size, device=device, dtype=torch.float32, seed=0, warn=False)
    reference = ReferenceEngine(ref_models)
    for rows, engine in engines.items():
        report[f"psnr_{rows}_vs_fp32_reference_db"] = box_psnr(engine, reference, avatar_dir)
        print(f"PSNR {rows}", report[f"psnr_{rows}_vs_fp32_reference_db"], flush=True)
        save(f"psnr_{rows}")
    del reference, ref_models

    for rows in ("full", "mask"):
        if left() < 90 or SMOKE:
            report[f"warm_compile_{rows}"] = "skipped: time budget"
            continue
        cmd = [sys.executable, "-c", WARM_COMPILE.format(batch=BATCH, rows=rows)]
        t = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=max(30, left()))
        report[f"warm_compile_{rows}"] = {"engine_s": float(done.stdout.strip().splitlines()[-1]) if done.returncode == 0
                                          else done.stderr[-2000:], "process_s": time.perf_counter() - t}
        print(f"warm-cache compile {rows}:", report[f"warm_compile_{rows}"], flush=True)
        save(f"warm_compile_{rows}")


if __name__ == "__main__":
    main()
