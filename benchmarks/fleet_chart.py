"""Issue 27's chart: live sessions held and render jobs per minute against GPUs, from the fleet_gpus.json
of each run (benchmarks/fleet_gpus.py), as an SVG (no plotting library needed).

    python benchmarks/fleet_chart.py OUT/fleet_x1/fleet_gpus.json OUT/fleet_x2/fleet_gpus.json -o docs/fleet_gpus.svg
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

W, H, PAD = 640, 300, 40


def panel(x0: int, title: str, points: list[tuple[int, float | None]], unit: str) -> list[str]:
    """One bar chart of `points` (GPUs, value) in a 280x220 box at x0, with the ideal linear line."""
    top = max([v for _, v in points if v] + [1.0]) * 1.25
    width, height, y0 = 260, 200, PAD + 20
    out = [f'<text x="{x0 + width / 2}" y="{PAD}" text-anchor="middle" font-size="14">{title}</text>',
           f'<line x1="{x0}" y1="{y0 + height}" x2="{x0 + width}" y2="{y0 + height}" stroke="#444"/>']
    base = next((v / g for g, v in points if v), None)
    bar = width / (2 * len(points) + 1)
    for i, (gpus, value) in enumerate(points):
        x = x0 + bar * (2 * i + 1)
        if value:
            h = height * value / top
            out.append(f'<rect x="{x:.1f}" y="{y0 + height - h:.1f}" width="{bar:.1f}" height="{h:.1f}" fill="#3b7dd8"/>')
            out.append(f'<text x="{x + bar / 2:.1f}" y="{y0 + height - h - 4:.1f}" text-anchor="middle" '
                       f'font-size="12">{value:g}</text>')
        if base:
            ideal = height * base * gpus / top
            out.append(f'<line x1="{x - 4:.1f}" x2="{x + bar + 4:.1f}" y1="{y0 + height - ideal:.1f}" '
                       f'y2="{y0 + height - ideal:.1f}" stroke="#d84b3b" stroke-dasharray="4 3"/>')
        out.append(f'<text x="{x + bar / 2:.1f}" y="{y0 + height + 16}" text-anchor="middle" font-size="12">'
                   f'{gpus} GPU{"s" if gpus > 1 else ""}</text>')
    out.append(f'<text x="{x0}" y="{y0 + height + 34}" font-size="11" fill="#555">{unit}; dashed: linear from one GPU</text>')
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", type=Path)
    p.add_argument("-o", "--out", type=Path, required=True)
    a = p.parse_args()
    runs = sorted((json.loads(r.read_text()) for r in a.reports), key=lambda r: r["gpus"])
    live = [(r["gpus"], (r.get("live") or {}).get("largest_n")) for r in runs]
    jobs = [(r["gpus"], (r.get("jobs_together") or {}).get("jobs_per_minute")) for r in runs]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             *panel(PAD, "live 720p25 sessions held", live, "largest N at 25 fps, no frame late"),
             *panel(W // 2 + PAD // 2, "render jobs per minute", jobs, "26 s 1080p monologue, submitted together"),
             "</svg>"]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(".part")
    tmp.write_text("\n".join(parts) + "\n")
    tmp.replace(a.out)


if __name__ == "__main__":
    main()
