"""How long a worker blocks writing a segment's reply while the parent's Python threads are busy: the pipe's size.

An encode worker sends a segment's packets (~4 MB at 1080p) in one write, which returns only when the parent's
reader thread has drained all but a pipe's worth; that thread reads a pipe's worth at a time and takes the GIL
back for each. A child writes 20 replies of 4.4 MB; the parent reads them on its main thread beside 0 or 2
threads spinning in Python, through the default pipe (64 KB) and one widened to 1 MB (media/processes.py).

    python benchmarks/pipe_replies.py [--switch-interval 0.0005]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from lipstream.media.processes import widen_pipe  # noqa: E402

CHILD = r"""
import os, sys, time
out = os.fdopen(1, "wb", buffering=0)
data = b"x" * 4_400_000
for i in range(20):
    t = time.perf_counter()
    out.write(len(data).to_bytes(4, "little") + data)
    sys.stderr.write(f"{time.perf_counter() - t:.4f}\n")
"""


def run(pipe_bytes: int | None, busy: int) -> tuple[float, float]:
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if pipe_bytes:
        widen_pipe(p.stdout.fileno(), pipe_bytes)
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x ^= i

    spinners = [threading.Thread(target=spin) for _ in range(busy)]
    for t in spinners:
        t.start()
    t0 = time.perf_counter()
    for _ in range(20):
        n = int.from_bytes(p.stdout.read(4), "little")
        p.stdout.read(n)
    wall = time.perf_counter() - t0
    stop.set()
    for t in spinners:
        t.join()
    blocked = sum(float(v) for v in p.stderr.read().decode().split())
    p.wait()
    return wall, blocked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switch-interval", type=float, default=0.0005)
    args = ap.parse_args()
    sys.setswitchinterval(args.switch_interval)
    for size in (None, 1 << 20):
        for busy in (0, 2):
            wall, blocked = run(size, busy)
            print(f"pipe {size or 65536} B, {busy} busy threads, switch {args.switch_interval * 1000:g} ms: "
                  f"20 replies in {wall:.3f} s, the writer blocked {blocked:.3f} s", flush=True)


if __name__ == "__main__":
    main()
