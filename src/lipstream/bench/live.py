"""`lipstream live-bench`: N live sessions fed speech in real time, with encode; latency per N.

Each session gets its own feeder: pauses of 0.5-1.5 s, utterances of 2-5 s pushed in 20 ms
chunks on the wall clock (absolute times, so a slow feeder does not drift), and a reader that
plays its frames. Latency is measured per speech frame, from the wall time the audio at the
frame's start was pushed to the time the frame was ready (rendered and H.264-encoded). The
first second of each run is left out (sessions start staggered over it). One engine serves
every N (captured and warmed once, as a server would: a 4 s run at the largest N per frame size
comes first and is not reported).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch

from lipstream.bench.figures import NO_CHART
from lipstream.bench.proc import process_cpu_s
from lipstream.fixtures import speech_like
from lipstream.live import LiveEngine, LiveFrame, LiveOptions, preset
from lipstream.models import MuseTalk

TARGET_P99_MS = 250.0
SETTLE_S = 1.0
WARMUP_S = 4.0  # per frame size, at the largest N, before the rows (not reported)


def _cpu_s(live: LiveEngine) -> float:
    """CPU seconds of this process and of its encode workers (processes of their own)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    workers = [process_cpu_s(pid) for pid in (live.encode_pool.pids if live.encode_pool is not None else [])]
    return r.ru_utime + r.ru_stime + sum(w for w in workers if w is not None)


async def _feed(session, rng: np.random.Generator, until: float, chunk_s: float, speech: np.ndarray) -> None:
    rate = 16_000
    step = round(rate * chunk_s)
    while time.monotonic() < until - 1.0:
        await asyncio.sleep(rng.uniform(0.5, 1.5))
        seconds = rng.uniform(2.0, 5.0)
        start = rng.integers(0, speech.size - int(5 * rate))
        clip = speech[start:start + int(seconds * rate)]
        t0 = time.monotonic()
        for k, i in enumerate(range(0, clip.size, step)):
            await asyncio.sleep(max(0.0, t0 + k * chunk_s - time.monotonic()))
            session.push_audio(clip[i:i + step], rate)
            if time.monotonic() > until:
                break
        session.end_utterance()


async def _lag(until: float, out: list) -> None:
    """How late the event loop wakes (feeders and readers share it): its own load is part of the latency."""
    while time.monotonic() < until:
        t = time.monotonic()
        await asyncio.sleep(0.01)
        out.append(time.monotonic() - t - 0.01)


async def _read(session, until: float, frames: list) -> None:
    async for item in session:
        if isinstance(item, LiveFrame):
            parts = item.stages_s()
            frames.append((item.frame, item.late, item.latency_s, item.utterance is not None, item.played_at,
                           len(item.packets), parts))
            if item.played_at > until:
                return


def run_sessions(live: LiveEngine, n: int, seconds: float, avatars: list[int], chunk_s: float = 0.02,
                 seed: int = 0) -> dict:
    """N sessions for `seconds`; the figures of one row."""
    speech = speech_like(30.0, 16_000, seed=seed)
    rng = np.random.default_rng(seed)
    device = live.device

    async def main() -> dict:
        sessions = []
        for k in range(n):
            sessions.append(live.open_session(avatars[k % len(avatars)]))
            await asyncio.sleep(SETTLE_S / n)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t_start, cpu0 = time.monotonic(), _cpu_s(live)
        busy0, steps0, frames0 = live.stats.gpu_busy_s, live.stats.steps, live.stats.frames
        core0 = live.stats.core_cpu_s
        cached0 = live.stats.idle_cached_frames
        batches0 = dict(live.stats.batch_sizes)
        until = t_start + seconds
        logs: list[list] = [[] for _ in sessions]
        tasks = [asyncio.create_task(_feed(s, np.random.default_rng(rng.integers(1 << 30)), until, chunk_s, speech))
                 for s in sessions]
        lags: list[float] = []
        monitor = asyncio.create_task(_lag(until, lags))
        await asyncio.gather(*[_read(s, until, log) for s, log in zip(sessions, logs)])
        monitor.cancel()
        wall = time.monotonic() - t_start
        for t in tasks:
            t.cancel()
        stats = [s.stats for s in sessions]
        for s in sessions:
            live.close_session(s)
        lat = [x[2] * 1000 for log in logs for x in log if x[2] is not None and x[4] > t_start + SETTLE_S]
        played = [x for log in logs for x in log if x[4] > t_start + SETTLE_S]
        parts = np.array([x[6] for x in played if x[6] is not None]) * 1000
        names = ("audio", "to_plan", "step", "encode")
        breakdown = {n: {f"p{q}": round(float(np.percentile(parts[:, k], q)), 1) for q in (50, 99)}
                     for k, n in enumerate(names)} if len(parts) else {}
        batches = {b: c - batches0.get(b, 0) for b, c in live.stats.batch_sizes.items() if c - batches0.get(b, 0)}
        row = {
            "sessions": n,
            "latency_ms": {f"p{q}": round(float(np.percentile(lat, q)), 1) for q in (50, 95, 99)} if lat else {},
            "latency_ms_max": round(max(lat), 1) if lat else None,
            # pushed -> last audio of its window pushed -> planned -> on the host -> encoded
            "latency_parts_ms": breakdown,
            "speech_frames": len(lat),
            "frames_played": len(played),
            "frames_late": sum(x[1] for x in played),
            "late_speech": sum(s.late_speech for s in stats),
            "arrived_after_play": sum(s.arrived_after_play for s in stats),
            "loop_lag_ms": {f"p{q}": round(1000 * float(np.percentile(lags, q)), 1) for q in (50, 99)} if lags else {},
            "frames_skipped": sum(s.skipped for s in stats),
            "underruns": sum(s.underruns for s in stats),
            "dropped_unread": sum(s.dropped_unread for s in stats),
            "fps_per_session": round(len(played) / max(1e-9, wall - SETTLE_S) / n, 2),
            "engine_fps": round((live.stats.frames - frames0) / wall, 1),  # frames through the steps
            "idle_kept_fps": round((live.stats.idle_cached_frames - cached0) / wall, 1),  # idle, from the kept loops
            "steps": live.stats.steps - steps0,
            "mean_batch": round((live.stats.frames - frames0) / max(1, live.stats.steps - steps0), 1),
            "batch_sizes": dict(sorted(batches.items())),
            "gpu_busy_pct": round(100 * (live.stats.gpu_busy_s - busy0) / wall, 1) if device.type == "cuda" else None,
            "core_busy_pct": round(100 * (live.stats.core_cpu_s - core0) / wall, 1),  # the core thread's own CPU
            "cpu_pct": round(100 * (_cpu_s(live) - cpu0) / wall / (os.cpu_count() or 1), 1),
            "cpu_cores_busy": round((_cpu_s(live) - cpu0) / wall, 2),
            "gpu_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
            "wall_s": round(wall, 2),
        }
        row["holds"] = bool(lat) and row["latency_ms"]["p99"] <= TARGET_P99_MS and row["frames_late"] == 0
        return row

    return asyncio.run(main())


def run(models: MuseTalk, out: Path, *, sizes: list[tuple[int, int]], counts: list[int], fps: int = 25,
        seconds: float = 20.0, options: LiveOptions | str = "realtime", avatars_per_size: int = 4,
        compile: str = "off", command: str = "", progress=print) -> dict:
    """Every size x every N; writes live_bench.json and .md (and a chart) into `out` after each row."""
    from lipstream.bench.scenarios import _avatar

    # The event loop (feeders, readers) competes for the GIL with the core and encoder threads:
    # a 1 ms switch interval instead of 5 keeps it waking on time.
    sys.setswitchinterval(0.001)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    work.mkdir(exist_ok=True)
    opts = preset(options) if isinstance(options, str) else options
    opts = opts.replace(capacity_fps=math.inf, max_sessions=max(max(counts), 1))  # the bench goes past admission
    live = LiveEngine(models, opts, inductor=compile)
    slots: dict[tuple[int, int], list[int]] = {}
    t = time.perf_counter()
    for w, h in sizes:
        for k in range(avatars_per_size):
            name = f"p{w}x{h}_{k}"
            if not (work / "avatars" / name).exists():
                _avatar(work, name, models, w, h, fps, k)
            slots.setdefault((w, h), []).append(live.add_avatar(work / "avatars" / name))
    built = time.perf_counter() - t
    t = time.perf_counter()
    live.start()
    report = {"device": torch.cuda.get_device_name(live.device) if live.device.type == "cuda" else "cpu",
              "torch": torch.__version__, "commit": os.environ.get("LIPSTREAM_COMMIT", ""), "command": command,
              "date": time.strftime("%Y-%m-%d"), "fps": fps, "seconds": seconds, "compile": compile,
              "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(opts).items()
                          if k != "capacity_fps"},
              "random_weights": models.random_weights, "avatars_s": round(built, 1),
              "startup_s": round(time.perf_counter() - t, 1),
              "step_s": {b: round(s, 4) for b, s in live.step_s.items()},
              "measured_capacity_fps": round(max(b / s for b, s in live.step_s.items()), 1), "rows": []}
    try:
        for (w, h) in sizes:
            # a server is warm before it admits anyone: the first minutes' one-off costs (the CUDA
            # allocator growing, encoder processes' first frames) are not any N's latency
            t = time.perf_counter()
            run_sessions(live, max(counts), WARMUP_S, slots[(w, h)], seed=99)
            report.setdefault("warmup_s", {})[f"{w}x{h}"] = round(time.perf_counter() - t, 1)
            for n in counts:
                row = {"size": f"{w}x{h}", **run_sessions(live, n, seconds, slots[(w, h)])}
                report["rows"].append(row)
                progress(json.dumps(row))
                write(report, out)
    finally:
        live.close()
    return report


def largest(report: dict, size: str) -> int | None:
    held = [r["sessions"] for r in report["rows"] if r["size"] == size and r["holds"]]
    return max(held) if held else None


def write(report: dict, out: Path) -> None:
    (out / "live_bench.json").write_text(json.dumps(report, indent=1))
    lines = [f"# live-bench: {report['device']}, {report['date']}, commit {report['commit'] or '?'}", "",
             f"`{report['command']}`", "",
             f"{report['fps']} fps sessions, {report['seconds']} s each run, encode on (H.264 ultrafast zerolatency + "
             f"{report['options']['audio_codec']}), compile {report['compile']}, "
             f"{'random' if report['random_weights'] else 'real'} weights. Engine start {report['startup_s']} s; "
             f"step times {report['step_s']}.", "",
             "| size | N | p50 / p95 / p99 ms | max ms | late | skipped | fps/session | engine fps | mean batch "
             "| GPU busy | core thread busy | CPU | GPU mem | holds |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        q = r["latency_ms"]
        lines.append(f"| {r['size']} | {r['sessions']} | {q.get('p50')} / {q.get('p95')} / {q.get('p99')} | "
                     f"{r['latency_ms_max']} | {r['frames_late']} | {r['frames_skipped']} | {r['fps_per_session']} | "
                     f"{r['engine_fps']} | {r['mean_batch']} | {r['gpu_busy_pct']}% | {r.get('core_busy_pct')}% | "
                     f"{r['cpu_pct']}% | "
                     f"{r['gpu_mem_gib']} GiB | {'yes' if r['holds'] else 'no'} |")
    lines.append("")
    for size in sorted({r["size"] for r in report["rows"]}):
        lines.append(f"- {size}: largest N with p99 <= {TARGET_P99_MS:.0f} ms and no frame late: "
                     f"**{largest(report, size)}**")
    if not chart(report, out / "live_bench.png"):
        lines += ["", f"({NO_CHART})"]
    (out / "live_bench.md").write_text("\n".join(lines) + "\n")


def chart(report: dict, path: Path) -> bool:
    """Latency (p50, p99) against N, one line pair per frame size; False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for size in sorted({r["size"] for r in report["rows"]}):
        rows = [r for r in report["rows"] if r["size"] == size and r["latency_ms"]]
        n = [r["sessions"] for r in rows]
        for q, style in (("p50", "--"), ("p99", "-")):
            ax.plot(n, [r["latency_ms"][q] for r in rows], style, marker="o", label=f"{size} {q}")
        for r in rows:
            if r["frames_late"]:
                ax.annotate(f"{r['frames_late']} late", (r["sessions"], r["latency_ms"]["p99"]), fontsize=7)
    ax.axhline(TARGET_P99_MS, color="grey", lw=0.8)
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("audio -> encoded frame latency, ms")
    ax.set_title(f"live-bench, {report['device']}, {report['fps']} fps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def parse_sizes(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in s.lower().split("x")) for s in text.split(",") if s.strip()]

