"""Time what a user types: `lipstream compile`, `render` and `warmup`, default flags, fresh processes.

Each run is a new process; the wall clock is taken around it, and the first encoded packet is
what the CLI reports counted from the process's own start. The sequence is what a user meets on
a new machine: a render with nothing cached (the cache folders are fresh: the uncompiled engine),
`lipstream warmup` (builds the compiled engine), then warm renders with the default flags (the
compiled engine), with `--decode-rows full` (the exact path) and with `--no-compile`. Each
output is decoded and checked: frame count, strictly rising DTS, audio and video length and start.

    python benchmarks/user_render.py --out DIR [--size 1920x1080 --fps 30 --seconds 25.83 --runs 3]
        [--no-warmup] [--track-truth] [-- EXTRA RENDER FLAGS]

`--track-truth` compiles the avatar from the fixture's own landmarks (no dlib model needed).
Writes DIR/user_render.json and prints a markdown table.

Rerun (a CUDA GPU, the `lipstream` package installed, e.g. `pip install -e .`: each run is a
`python -m lipstream` process):

    python3 benchmarks/user_render.py --out DIR --track-truth --runs 2

`bash benchmarks/gpu_run.sh render` runs it on the GPU; docs/BENCHMARKS.md reports it ("Offline render",
"Avatar compile").
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import av


def lipstream(*args: str, cwd: Path, env: dict | None = None) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "lipstream", *args], cwd=cwd, capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "200", **(env or {})})
    return time.perf_counter() - t, p


def render_row(kind: str, flags: list[str], work: Path, run: int, env: dict, report: dict, dest: Path) -> dict:
    out = work / f"out{run}.mp4"
    wall, p = lipstream("render", "--avatar", "anchor", "--audio", "speech.wav", "-o", out.name,
                        "--random-weights", "--timings", *flags, cwd=work, env=env)
    row = {"run": run, "kind": kind, "flags": flags, "rc": p.returncode, "wall_s": round(wall, 2)}
    m = re.search(r"first encoded packet ([\d.]+) s after it started", p.stdout)
    row["first_packet_s"] = float(m.group(1)) if m else None
    m = re.search(r"in ([\d.]+) s = ([\d.]+) fps", p.stdout)
    row["render_s"], row["render_fps"] = (float(m.group(1)), float(m.group(2))) if m else (None, None)
    m = re.search(r"^(\w+ engine|reference path): .*$", p.stderr, re.M)
    row["engine"] = m.group(0) if m else None
    row["timings"] = p.stderr[p.stderr.find("start-up and render"):][-2500:] if "start-up and render" in p.stderr else ""
    if p.returncode == 0:
        row.update(probe(out))
        out.unlink()
    else:
        row["tail"] = p.stderr[-1500:]
    print(json.dumps({k: v for k, v in row.items() if k != "timings"}), flush=True)
    print(row["timings"], flush=True)
    report["runs"].append(row)
    dest.write_text(json.dumps(report, indent=2))  # after every run: a call cut short keeps what it measured
    return row


def probe(path: Path) -> dict:
    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        packets = [p for p in c.demux(v) if p.size]
        dts = [p.dts for p in packets]
        out = {"video_packets": len(packets), "dts_rising": all(b > x for x, b in zip(dts, dts[1:])),
               "b_frames": sum(p.pts < max(q.pts for q in packets[:k + 1]) for k, p in enumerate(packets)),
               "audio_s": float(a.duration * a.time_base)}
    with av.open(str(path)) as c:
        frames = list(c.decode(video=0))
        out.update(frames=len(frames), video_start=float(frames[0].time))
        out["video_s"] = float(frames[-1].time) + float(1 / c.streams.video[0].average_rate)
    with av.open(str(path)) as c:
        out["audio_start"] = float(next(c.decode(audio=0)).time)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--size", default="1920x1080")
    ap.add_argument("--fps", type=int, default=30)
    ap.add_argument("--loop-seconds", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, default=25.83, help="speech length (775 frames at 30 fps)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-warmup", action="store_true", help="skip `lipstream warmup`")
    ap.add_argument("--no-exact", action="store_true", help="skip the --decode-rows full runs")
    ap.add_argument("--keep-cache", action="store_true", help="reuse DIR/cache (and DIR/work) from an earlier run")
    ap.add_argument("--track-truth", action="store_true", help="compile from the fixture's landmarks (no dlib)")
    ap.add_argument("--also", action="append", default=[],
                    help="flags of another warm row, run after each warm default run (e.g. '--encoder-threads')")
    ap.add_argument("extra", nargs="*", help="extra render flags, after --")
    args = ap.parse_args()
    from lipstream.fixtures import speech_like, write_audio
    from lipstream.fixtures.avatar import action_loop, write_track

    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    cache = args.out / "cache"  # fresh: nothing compiled, no Inductor kernels
    env = {"LIPSTREAM_CACHE": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")}
    width, height = (int(v) for v in args.size.split("x"))
    t = time.perf_counter()
    if args.keep_cache and (work / "avatars").is_dir():
        args.track_truth = False
    truth = action_loop(work / "anchor.mp4", width=width, height=height, seconds=args.loop_seconds, fps=args.fps)
    write_audio(work / "speech.wav", speech_like(args.seconds, 16000), 16000)
    track = []
    if args.track_truth:
        write_track(truth, work / "anchor.track.json")
        track = ["--track", "anchor.track.json"]
    report = {"machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
              "av": av.__version__, "commit": os.environ.get("LIPSTREAM_COMMIT", ""), "size": args.size,
              "fps": args.fps, "speech_s": args.seconds, "expected_frames": math.ceil(args.seconds * args.fps),
              "extra_flags": args.extra, "fixtures_s": round(time.perf_counter() - t, 2), "runs": []}

    runs = report["runs"]
    dest = args.out / "user_render.json"
    if not args.keep_cache:
        shutil.rmtree(cache, ignore_errors=True)
        wall, p = lipstream("compile", "anchor.mp4", "-o", "avatars", "--random-weights", *track, cwd=work, env=env)
        report["compile"] = {"wall_s": round(wall, 2), "rc": p.returncode, "tail": p.stdout[-600:] + p.stderr[-600:]}
        print(f"compile: rc {p.returncode}, {wall:.2f} s", flush=True)
        render_row("nothing cached (first on this machine)", args.extra, work, 0, env, report, dest)
    if not args.no_warmup:
        wall, p = lipstream("warmup", "--random-weights", cwd=work, env=env)
        report["warmup"] = {"wall_s": round(wall, 2), "rc": p.returncode, "tail": (p.stdout + p.stderr)[-3000:]}
        print(f"warmup: rc {p.returncode}, {wall:.2f} s\n{report['warmup']['tail']}", flush=True)
    for run in range(args.runs):
        render_row("warm, defaults", args.extra, work, len(runs), env, report, dest)
        for flags in args.also:  # interleaved with the defaults: the machine's drift hits both alike
            render_row(f"warm, {flags}", [*flags.split(), *args.extra], work, len(runs), env, report, dest)
    for run in range(0 if args.no_exact else args.runs):
        render_row("warm, exact (--decode-rows full)", ["--decode-rows", "full", *args.extra], work, len(runs), env,
                   report, dest)
    render_row("warm, --no-compile", ["--no-compile", *args.extra], work, len(runs), env, report, dest)
    print("\n| run | rc | process wall | first packet | render_program | frames | DTS rising | engine |")
    print("|---|---|---|---|---|---|---|---|")
    for r in report["runs"]:
        print(f"| {r['kind']} | {r['rc']} | {r['wall_s']} s | {r.get('first_packet_s')} s | {r.get('render_s')} s "
              f"({r.get('render_fps')} fps) | {r.get('frames')} | {r.get('dts_rising')} | {r.get('engine')} |")


if __name__ == "__main__":
    main()
