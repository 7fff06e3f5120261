"""What a busy event loop does to the live core thread's eager work: the GIL convoy, measured.

Every PyTorch op drops the GIL while it runs and takes it back after; when another thread runs
Python meanwhile (`lipstream serve`'s event loop ran aiortc's RTP, SRTP and ICE for every session
until serve/rtc.py moved them to processes of their own),
taking it back waits for that thread to give it up, which CPython asks for only after the switch
interval (5 ms by default). An eager Whisper encoder call is about a hundred ops, so a call that
computes in a few milliseconds can take hundreds. On the H200 at 23 sessions the core thread's
frames waited ~1 s in the render stage with the GPU 6% busy (docs/BENCHMARKS.md).

This runs the live engine's streaming Whisper (StreamingWhisper, the tiny or full-size encoder on
the CPU or a GPU) on a thread, alone and beside threads that run pure Python, at several switch
intervals, eager and traced (TorchScript runs the traced ops with the GIL released), and reports
the time a call takes:

    python -m lipstream.bench.gil_convoy [--size tiny|full] [--device cpu] [--windows 16] [--seconds 3]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np


def _busy(stop: threading.Event) -> None:
    """Pure Python, as an event loop packetising media is: it holds the GIL whenever it can."""
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x ^= i * i


def run_calls(whisper, jobs, seconds: float, busy_threads: int, interval_s: float) -> dict:
    """Calls of whisper.run(jobs) for `seconds` on a thread of their own, with `busy_threads` beside."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    stop = threading.Event()
    others = [threading.Thread(target=_busy, args=(stop,), daemon=True) for _ in range(busy_threads)]
    times: list[float] = []

    def calls() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.perf_counter()
            whisper.run(jobs)
            if whisper.device.type == "cuda":
                import torch

                torch.cuda.synchronize(whisper.device)
            times.append(time.perf_counter() - t)

    try:
        for t in others:
            t.start()
        worker = threading.Thread(target=calls)
        worker.start()
        worker.join()
    finally:
        stop.set()
        for t in others:
            t.join()
        sys.setswitchinterval(old)
    ms = np.asarray(times[1:] or times) * 1000
    return {"busy_threads": busy_threads, "switch_interval_ms": interval_s * 1000, "calls": len(times),
            "p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("tiny", "full"), default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--windows", type=int, default=16, help="windows per call (sessions speaking)")
    p.add_argument("--seconds", type=float, default=3.0, help="per row")
    a = p.parse_args()

    import torch

    from lipstream.live.features import FeatureTable, StreamingWhisper, WindowJob
    from lipstream.live.options import preset
    from lipstream.models import load_musetalk

    o = preset("realtime")
    m = load_musetalk(random_weights=True, size=a.size, device=a.device, seed=0, components=("whisper",))
    p0 = next(m.whisper.parameters())
    table = FeatureTable(a.windows, 256, p0.device, p0.dtype)
    calls = {trace: StreamingWhisper(m, table, o.context_steps, o.hop_steps, o.lookahead_steps, trace=trace)
             for trace in (False, True)}
    rng = np.random.default_rng(0)
    jobs = [WindowJob(rng.standard_normal(calls[False].samples).astype(np.float32) * 0.1, 0, k, False, [table.row(k, 0)])
            for k in range(a.windows)]
    torch.set_num_threads(1)  # one core's compute: the figure is the waiting
    print(f"streaming Whisper ({a.size}, {a.device}), {a.windows} windows a call, {a.seconds:g} s a row")
    print("| call | busy Python threads | switch interval ms | calls | p50 ms | p99 ms |\n|---|---|---|---|---|---|")
    for trace, whisper in calls.items():
        whisper.run(jobs)  # traced at its first call of a size
        for busy in (0, 1, 2):
            for interval in (0.005, 0.001, 0.0005, 0.0002):
                if busy == 0 and interval != 0.005:
                    continue
                r = run_calls(whisper, jobs, a.seconds, busy, interval)
                print(f"| {'traced' if trace else 'eager'} | {busy} | {r['switch_interval_ms']:g} | {r['calls']} | "
                      f"{r['p50_ms']} | {r['p99_ms']} |", flush=True)


if __name__ == "__main__":
    main()
