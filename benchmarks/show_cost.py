"""What the newsroom layers cost: the same monologue broadcast with and without every layer.

    python benchmarks/show_cost.py --work DIR [--runs 3] [--variants plain,show,show-5ms]
DIR holds avatars/anchor and speech.wav (benchmarks/user_render.py's DIR/work: the 26 s 1080p30
monologue); LIPSTREAM_CACHE and TORCHINDUCTOR_CACHE_DIR are passed through, so a warm cache is used.
Each run is `lipstream broadcast SCRIPT -o OUT --random-weights --timings` in a fresh process,
the plain script and the show alternating: process wall and the render's own seconds (frames),
then the medians and the show's cost over the plain one. The show: a lower third, a looping
video picture-in-picture for most of the speech, a still cutaway, the logo, the ticker and a
ducked music bed (examples/newsroom's media)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

MEDIA = Path(__file__).resolve().parents[1] / "examples" / "newsroom"
PLAIN = "scenes:\n  - {avatar: anchor, audio: speech.wav}\n"
SHOW = """scenes:
  - avatar: anchor
    audio: speech.wav
    lower_third: {title: "Anna Berg", subtitle: "City desk, Berlin", from: 0.5, to: 8.0}
    pip: {source: footage.mp4, box: [1180, 120, 1820, 480], from: 2.0, to: 24.0, loop: true}
    cutaway: {source: chart.png, from: 10.0, to: 13.0}
overlays:
  logo: {image: logo.png, corner: top-right, margin: 32, height: 64}
  ticker: {text: "Breaking: tram line approved  +++  Markets close higher  +++  Weather: sunny, 21 C", speed: 160}
music: {file: bed.m4a, gain_db: -18, duck_db: -12}
"""


# the show with the render loop's GIL switch interval at CPython's default (5 ms) instead of render/loop.py's
SLOW_SWITCH = ("import sys, lipstream.render.loop as r; r.LOOP_SWITCH_INTERVAL_S = 0.005; from lipstream.cli import entry; "
               "sys.argv[0] = 'lipstream'; entry()")


def run(variant: str, work: Path, i: int) -> dict:
    script = "plain.yaml" if variant == "plain" else "show.yaml"
    out = work / f"cost{i}.mp4"
    start = ["-c", SLOW_SWITCH] if variant == "show-5ms" else ["-m", "lipstream"]
    t = time.perf_counter()
    p = subprocess.run([sys.executable, *start, "broadcast", script, "-o", out.name, "--avatars", "avatars",
                        "--random-weights", "--timings"], cwd=work, capture_output=True, text=True,
                       env={**os.environ, "COLUMNS": "320"})
    row = {"script": script, "variant": variant, "rc": p.returncode, "wall_s": round(time.perf_counter() - t, 2)}
    m = re.search(r"in ([\d.]+) s = ([\d.]+) fps", p.stdout + p.stderr)
    row["render_s"], row["fps"] = (float(m.group(1)), float(m.group(2))) if m else (None, None)
    m = re.search(r"first encoded packet ([\d.]+) s", p.stdout + p.stderr)
    row["first_packet_s"] = float(m.group(1)) if m else None
    # the --timings table's rows (graph capture, the show's wait past it, frames, ...): where the cost went
    found = re.findall(r"^│ ([^│]+?)\s+│\s+(-?[\d.]+)\s+│([^│]*)│", p.stderr, re.M)
    row["steps"] = {k.strip(): float(v) for k, v, _ in found}
    row["loop"] = next((n.strip() for k, _, n in found if k.strip() == "frames (render loop)"), None)  # its waits
    if p.returncode:
        row["tail"] = (p.stdout + p.stderr)[-1200:]
    out.unlink(missing_ok=True)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--variants", default="plain,show",
                    help="plain, show, show-5ms (the show at CPython's default GIL switch interval in the loop)")
    args = ap.parse_args()
    for name in ("logo.png", "chart.png", "footage.mp4", "bed.m4a"):
        shutil.copy(MEDIA / name, args.work / name)
    (args.work / "plain.yaml").write_text(PLAIN)
    (args.work / "show.yaml").write_text(SHOW)
    rows: dict[str, list[dict]] = {v: [] for v in args.variants.split(",")}
    for i in range(args.runs):  # interleaved: the machine's drift hits every variant alike
        for variant in rows:
            rows[variant].append(run(variant, args.work, i))
    summary = {}
    for variant, rs in rows.items():
        ok = [r for r in rs if r["rc"] == 0 and r["render_s"]]
        summary[variant] = {k: statistics.median(r[k] for r in ok) if ok else None for k in ("wall_s", "render_s")}
    print(json.dumps(summary), flush=True)
    a = summary.get("plain")
    for variant, b in summary.items():
        if variant != "plain" and a and a["render_s"] and b["render_s"]:
            print(f"{variant} costs {100 * (b['render_s'] / a['render_s'] - 1):+.1f}% render time "
                  f"({a['render_s']:.2f} -> {b['render_s']:.2f} s), {100 * (b['wall_s'] / a['wall_s'] - 1):+.1f}% "
                  f"process wall ({a['wall_s']:.2f} -> {b['wall_s']:.2f} s), medians of {args.runs}", flush=True)


if __name__ == "__main__":
    main()
