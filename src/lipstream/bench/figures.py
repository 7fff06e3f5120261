"""Pictures for the bench report: an fps chart and side-by-side freeze frames with a seam close-up."""

from __future__ import annotations

from pathlib import Path

import av
import cv2
import numpy as np


NO_CHART = "no chart: matplotlib is not installed (pip install matplotlib)"


def fps_chart(report: dict, path: Path) -> Path | None:
    """The fps of every row as bars, written to `path`; None (nothing written) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    labels = [f"{r['scenario']}: {r['mode']}" for r in rows]
    colours = ["#999999" if r["mode"] == "legacy" else "#2a7ab0" if r["mode"] == "fast" else "#8fb8d6" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(rows) + 1.2))
    ax.barh(labels[::-1], [r["fps"] for r in rows][::-1], color=colours[::-1])
    for i, r in enumerate(rows[::-1]):
        ax.text(r["fps"], i, f" {r['fps']:.0f}", va="center", fontsize=8)
    ax.set_xlabel("frames per second, end to end (higher is better)")
    ax.set_title(f"LipStream bench: {report['device']}, {report['size']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def frame_at(video: Path, seconds: float) -> np.ndarray:
    """RGB frame shown at `seconds` (the last one if the video is shorter)."""
    last = None
    with av.open(str(video)) as c:
        for frame in c.decode(video=0):
            last = frame
            if frame.time is not None and frame.time >= seconds:
                break
    return last.to_ndarray(format="rgb24")


def freeze_frames(legacy: Path, fast: Path, box: list[int], path: Path, seconds: float = 2.0) -> Path:
    """Legacy | fast at `seconds`, and below them a 3x close-up of the lower-left blend seam of each."""
    a, b = frame_at(legacy, seconds), frame_at(fast, seconds)
    x1, y1, x2, y2 = box
    h, w = y2 - y1, x2 - x1
    seam = (slice(max(0, y1 + h // 2), min(a.shape[0], y2 + h // 8)), slice(max(0, x1 - w // 8), x1 + w // 2))
    zoom = [cv2.resize(f[seam], None, fx=3, fy=3, interpolation=cv2.INTER_NEAREST) for f in (a, b)]
    top = np.concatenate([a, b], axis=1)
    bottom = np.concatenate(zoom, axis=1)
    scale = top.shape[1] / bottom.shape[1]
    bottom = cv2.resize(bottom, (top.shape[1], int(bottom.shape[0] * scale)), interpolation=cv2.INTER_NEAREST)
    picture = np.concatenate([top, bottom], axis=0)
    for text, x in (("legacy", 10), ("fast", a.shape[1] + 10)):
        cv2.putText(picture, text, (x, 40), cv2.FONT_HERSHEY_SIMPLEX, 1.2, (255, 255, 0), 2)
    cv2.imwrite(str(path), cv2.cvtColor(picture, cv2.COLOR_RGB2BGR))
    return path
