"""MP4Writer's segment encoders alone: threads or worker processes, with or without a GIL-holding producer.

775 moving 1080p I420 frames from memory into MP4Writer (no GPU), as a one-shot render hands them over.
`--producer-ms` adds a thread that spins in Python that long, then sleeps 0.1 ms, over and over: a busy
GIL (as the render's producer launching batches and the muxer make it), which threads lose to and
processes should not. The frames are harder to encode than a presenter's (about 3x the bytes).

  python benchmarks/encoders_alone.py [--frames 775] [--encoders N[,N...]] [--runs 2] [--producer-ms 1.0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from lipstream.media.mp4 import MP4Writer  # noqa: E402
from lipstream.options import default_encoders  # noqa: E402

W, H, FPS = 1920, 1080, Fraction(30)


def frames(n: int) -> list[np.ndarray]:
    """A textured picture that moves a little each frame, and a few distinct ones cycled (encodes like video)."""
    rng = np.random.default_rng(0)
    base = (rng.random((H // 8 + 40, W // 8 + 40)) * 255).astype(np.float32)
    base = np.kron(base, np.ones((8, 8), np.float32))
    yy, xx = np.mgrid[0:H, 0:W]
    out = []
    for i in range(min(n, 60)):
        y = (base[i // 3:i // 3 + H, i:i + W] * 0.15 + ((xx + yy + 4 * i) % 256) * 0.85).astype(np.uint8)
        u = np.full((H // 4, W), 110 + i % 30, np.uint8)
        v = np.full((H // 4, W), 140 - i % 20, np.uint8)
        out.append(np.concatenate([y, u, v]))
    return [out[i % len(out)] for i in range(n)]


def run(pictures: list[np.ndarray], encoders: int, processes: bool, producer_ms: float) -> dict:
    audio = np.zeros(int(len(pictures) / FPS * 48_000), np.float32)
    stop = threading.Event()

    def producer() -> None:  # holds the GIL in pure Python, producer_ms per frame's worth of time
        while not stop.is_set():
            t = time.perf_counter()
            while time.perf_counter() - t < producer_ms / 1000:
                pass
            time.sleep(0.0001)

    spinner = threading.Thread(target=producer, daemon=True) if producer_ms > 0 else None
    with tempfile.TemporaryDirectory() as tmp:
        t0, cpu0 = time.perf_counter(), time.process_time()
        with MP4Writer(Path(tmp) / "o.mp4", W, H, FPS, audio, crf=18, x264_preset="ultrafast", encoders=encoders,
                       processes=processes, total_frames=len(pictures)) as out:
            opened = time.perf_counter() - t0
            if spinner:
                spinner.start()
            worker0 = out.worker_cpu_s()
            for f in pictures:
                out.write(f)
            worker = out.worker_cpu_s() - worker0
        wall = time.perf_counter() - t0
        stop.set()
        first = (out.first_packet_at or t0) - t0
        size = (Path(tmp) / "o.mp4").stat().st_size
    cores = (time.process_time() - cpu0 + worker) / wall
    return {"encoders": encoders, "as": "processes" if processes else "threads", "producer_ms": producer_ms,
            "fps": round(len(pictures) / wall, 1), "wall_s": round(wall, 3), "open_s": round(opened, 3),
            "first_packet_s": round(first, 3), "cores_busy": round(cores, 1), "mb": round(size / 1e6, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--frames", type=int, default=775)
    ap.add_argument("--encoders", default=str(default_encoders(os.cpu_count() or 1)), help="a comma list")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--producer-ms", type=float, default=1.0)
    a = ap.parse_args()
    pictures = frames(a.frames)
    from lipstream.media.segment_pool import segment_pool

    counts = [int(n) for n in a.encoders.split(",")]
    for n in counts:
        segment_pool(n)  # started once, as a render's CLI does before its networks load
    time.sleep(1.0)
    for n in counts:
        for producer_ms in dict.fromkeys([0.0, a.producer_ms]):
            for processes in (False, True):
                for _ in range(a.runs):
                    print(json.dumps(run(pictures, n, processes, producer_ms)), flush=True)


if __name__ == "__main__":
    main()
