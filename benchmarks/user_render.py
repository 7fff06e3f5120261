"""Time what a user types: `lipstream compile` and `lipstream render`, default flags, fresh processes.

Each run is a new process; the wall clock is taken around it, and the first encoded packet is
what the CLI reports counted from the process's own start. The first render on a machine is
"cold" (no file cache, nothing compiled), the next ones "warm". Each output is decoded and
checked: frame count, strictly rising DTS, audio and video length and start.

    python benchmarks/user_render.py --out DIR [--size 1920x1080 --fps 30 --seconds 25.83 --runs 3]
        [-- EXTRA RENDER FLAGS]

Writes DIR/user_render.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import av


def lipstream(*args: str, cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "lipstream", *args], cwd=cwd, capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "200"})
    return time.perf_counter() - t, p


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
    ap.add_argument("extra", nargs="*", help="extra render flags, after --")
    args = ap.parse_args()
    from lipstream.fixtures import speech_like, write_audio
    from lipstream.fixtures.avatar import action_loop

    work = args.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    width, height = (int(v) for v in args.size.split("x"))
    t = time.perf_counter()
    action_loop(work / "anchor.mp4", width=width, height=height, seconds=args.loop_seconds, fps=args.fps)
    write_audio(work / "speech.wav", speech_like(args.seconds, 16000), 16000)
    report = {"machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
              "av": av.__version__, "commit": os.environ.get("LIPSTREAM_COMMIT", ""), "size": args.size,
              "fps": args.fps, "speech_s": args.seconds, "expected_frames": math.ceil(args.seconds * args.fps),
              "extra_flags": args.extra, "fixtures_s": round(time.perf_counter() - t, 2), "runs": []}

    wall, p = lipstream("compile", "anchor.mp4", "-o", "avatars", "--random-weights", cwd=work)
    report["compile"] = {"wall_s": round(wall, 2), "rc": p.returncode, "tail": p.stdout[-600:] + p.stderr[-600:]}
    print(f"compile: rc {p.returncode}, {wall:.2f} s", flush=True)
    for run in range(args.runs):
        out = work / f"out{run}.mp4"
        wall, p = lipstream("render", "--avatar", "anchor", "--audio", "speech.wav", "-o", out.name,
                            "--random-weights", *args.extra, cwd=work)
        row = {"run": run, "kind": "cold (first on this machine)" if run == 0 else "warm", "rc": p.returncode,
               "wall_s": round(wall, 2)}
        m = re.search(r"first encoded packet ([\d.]+) s after it started", p.stdout)
        row["first_packet_s"] = float(m.group(1)) if m else None
        m = re.search(r"in ([\d.]+) s = ([\d.]+) fps", p.stdout)
        row["render_s"], row["render_fps"] = (float(m.group(1)), float(m.group(2))) if m else (None, None)
        if p.returncode == 0:
            row.update(probe(out))
            out.unlink()
        else:
            row["tail"] = p.stderr[-1500:]
        report["runs"].append(row)
        print(json.dumps(row), flush=True)
    (args.out / "user_render.json").write_text(json.dumps(report, indent=2))
    print("\n| run | rc | process wall | first packet | render_program | frames | DTS rising | B-frames |")
    print("|---|---|---|---|---|---|---|---|")
    for r in report["runs"]:
        print(f"| {r['kind']} | {r['rc']} | {r['wall_s']} s | {r.get('first_packet_s')} s | {r.get('render_s')} s "
              f"({r.get('render_fps')} fps) | {r.get('frames')} | {r.get('dts_rising')} | {r.get('b_frames')} |")


if __name__ == "__main__":
    main()
