"""The agent-stack adapters under load on one GPU: N Pipecat pipelines (LipStreamVideoService) and N
LiveKit VideoGenerators driven by a local AvatarRunner loop, in one process on one LiveEngine.

Each pipeline/generator is fed TTS-like speech in real time (20 ms chunks, utterances of 2-5 s,
pauses of 0.5-1.5 s) and read the way its stack reads it (bench/pipecat_load.py,
bench/livekit_load.py). A row holds when every one of the N gets its pictures at the session's
frame rate (the slowest >= 98% of it), no speech picture lacks its audio right after it, and no
speech frame is late. The largest N that holds, per stack, is the figure docs/BENCHMARKS.md reports
("Agent stacks"); `bash benchmarks/gpu_run.sh integrations` runs it on the GPU.

    python3 benchmarks/integrations.py --stacks pipecat,livekit --sessions 8,16,20,24 \\
        --size 1280x720 --seconds 12 --out OUT   (full-size random weights on the GPU)

On the CPU (`--device cpu --random-size tiny --size 320x180 --fps 4 --sessions 2`) it is the
smoke run of the same code. `--serve` (one stack): the engine in a `lipstream serve` process of
its own on loopback, the pipelines or generators in this one over `url=` (lipstream.client, WebRTC),
so their Python no longer shares a GIL with the engine's core thread; frames late are counted at
the clients. `--serve --bots`: as the stacks are deployed, a process per Pipecat bot, each through
a real transport (SmallWebRTC) to a viewer of its own (bench/pipecat_load.py's `bots`; a row then
also needs every viewer to receive the pictures at the frame rate), or a process per LiveKit room
(bench/livekit_load.py's `rooms`: LiveKit Agents runs a process per job, and `start_in_process(...,
url=)` puts the room's avatar there).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

import torch

HOLD_FPS = 0.98  # the slowest pipeline's share of the session fps for a row to hold
# Pipecat's output draws the current picture, sleeps a frame's duration, and draws again: 24.34-24.38 a second
# at 25 fps on a quiet H100 host, whatever feeds it. Its draws count as on time down to this share of the fps
DRAWN_FPS = 0.96


def holds(row: dict, fps: float) -> bool:
    """Every pipeline at the fps, each speaking picture with its audio, none late; through a transport, every
    transport drawing at its own pace (DRAWN_FPS) and every viewer receiving (nearly) all it drew."""
    return (row["fps_min"] >= HOLD_FPS * fps and row["misaligned"] == 0 and row.get("late_speech", 0) == 0
            and row["errors"] == 0 and row.get("client_share_min", 1.0) >= HOLD_FPS
            and row.get("transport_fps_min", fps) >= DRAWN_FPS * fps and not row.get("processes_failed"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stacks", default="pipecat,livekit")
    ap.add_argument("--sessions", default="8,16,20,24")
    ap.add_argument("--size", default="1280x720")
    ap.add_argument("--fps", type=int, default=25)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--warmup", type=float, default=4.0, help="a first run at the largest N, not reported")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--random-size", default="full")
    ap.add_argument("--out", type=Path, default=Path("integrations-bench"))
    ap.add_argument("--serve", action="store_true", help="the engine in a lipstream serve process (one stack)")
    ap.add_argument("--bots", action="store_true", help="with --serve: a process per pipeline (through a transport) "
                                                       "or per LiveKit room")
    ap.add_argument("--work", type=Path, default=None, help="where the generated avatar is kept (default: OUT/work)")
    ap.add_argument("--serve-flags", default="", help="with --serve: more `lipstream serve` flags (--no-compile: the "
                                                      "uncompiled engine, no package build beside the rows)")
    a = ap.parse_args()
    stacks = [s for s in a.stacks.split(",") if s]
    counts = [int(n) for n in a.sessions.split(",") if n]
    w, h = (int(v) for v in a.size.split("x"))

    from lipstream.bench.scenarios import _avatar
    from lipstream.engine.engines import FAST_INDUCTOR
    from lipstream.live import LiveEngine, preset
    from lipstream.models import load_musetalk

    sys.setswitchinterval(0.001)  # as live-bench: the event loop wakes on time beside the core thread
    a.out.mkdir(parents=True, exist_ok=True)
    work = a.work or a.out / "work"
    work.mkdir(parents=True, exist_ok=True)
    m = load_musetalk(None, device=a.device, random_weights=True, size=a.random_size, warn=False)
    name = f"p{w}x{h}"
    if not (work / "avatars" / name).exists():
        _avatar(work, name, m, w, h, a.fps, 0)
    if a.serve:
        del m
        serve_rows(a, stacks, counts, work, name, (w, h))
        return
    options = preset("realtime").replace(capacity_fps=math.inf, max_sessions=max(counts), encode=False)
    if a.device == "cpu":
        options = options.replace(playout_delay_s=3.0, buckets=(1, 2, 4))
    live = LiveEngine(m, options, inductor=FAST_INDUCTOR if a.device.startswith("cuda") else "off")
    live.add_avatar(work / "avatars" / name)
    t = time.perf_counter()
    live.start()
    report = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu",
              "torch": torch.__version__, "commit": os.environ.get("LIPSTREAM_COMMIT", ""),
              "command": " ".join(["python3", *sys.argv]), "date": time.strftime("%Y-%m-%d"),
              "size": a.size, "fps": a.fps, "seconds": a.seconds, "startup_s": round(time.perf_counter() - t, 1),
              "step_s": {b: round(s, 4) for b, s in live.step_s.items()}, "rows": [], "largest": {}}
    try:
        for stack in stacks:
            load = importlib.import_module(f"lipstream.bench.{stack}_load")
            if a.warmup:
                load.run(live, name, max(counts), a.warmup, size=(w, h), fps=a.fps)
            for n in counts:
                row = {"stack": stack, "n": n, **load.run(live, name, n, a.seconds, size=(w, h), fps=a.fps)}
                row["holds"] = holds(row, a.fps)
                report["rows"].append(row)
                print(json.dumps(row), flush=True)
                (a.out / "integrations.json").write_text(json.dumps(report, indent=1))
            held = [r["n"] for r in report["rows"] if r["stack"] == stack and r["holds"]]
            report["largest"][stack] = max(held) if held else None
    finally:
        live.close()
    (a.out / "integrations.json").write_text(json.dumps(report, indent=1))
    print("largest N that holds:", report["largest"])


def serve_rows(a, stacks: list[str], counts: list[int], work: Path, name: str, size: tuple[int, int]) -> None:
    """The rows with the engine in `lipstream serve` (a subprocess on loopback) and the pipelines here."""
    import subprocess

    import httpx

    if len(stacks) != 1:
        raise SystemExit("--serve: one stack at a time (--stacks pipecat or --stacks livekit)")
    load = importlib.import_module(f"lipstream.bench.{stacks[0]}_load")
    url = "http://127.0.0.1:8011"
    log = open(a.out / "serve.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "lipstream.cli", "serve", "--avatars", str(work / "avatars"),
                               "--random-weights", "--random-size", a.random_size, "--device", a.device,
                               "--port", "8011", "--data", str(a.out / "serve-data"), "--sessions-per-key", "64",
                               *shlex.split(a.serve_flags)],
                              stdout=log, stderr=subprocess.STDOUT)
    t = time.perf_counter()
    try:
        while True:
            if server.poll() is not None:
                raise SystemExit(f"lipstream serve exited ({server.returncode}): {a.out / 'serve.log'}")
            try:
                if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        report = {"device": a.device, "command": " ".join(["python3", *sys.argv]), "date": time.strftime("%Y-%m-%d"),
                  "commit": os.environ.get("LIPSTREAM_COMMIT", ""), "size": a.size, "fps": a.fps,
                  "seconds": a.seconds, "server_ready_s": round(time.perf_counter() - t, 1), "rows": [], "largest": {}}
        def rows_of(n: int, seconds: float) -> dict:
            if stacks == ["livekit"]:
                if a.bots:
                    return load.rooms(url, name, n, seconds, size, fps=a.fps)
                return load.run(None, name, n, seconds, size, fps=a.fps, url=url)
            if a.bots:
                return load.bots(url, name, n, seconds, size, fps=a.fps)
            return load.run(None, name, n, seconds, size=size, fps=a.fps, url=url)

        stack = stacks[0] + ("-processes" if a.bots else "-url")
        if a.warmup:
            rows_of(max(counts), a.warmup)
        for n in counts:
            row = {"stack": stack, "n": n, **rows_of(n, a.seconds)}
            row["holds"] = holds(row, a.fps)
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
            (a.out / "integrations.json").write_text(json.dumps(report, indent=1))
        held = [r["n"] for r in report["rows"] if r["holds"]]
        report["largest"][stack] = max(held) if held else None
        (a.out / "integrations.json").write_text(json.dumps(report, indent=1))
        print("largest N that holds:", report["largest"])
    finally:
        server.terminate()
        server.wait(30)
        log.close()


if __name__ == "__main__":
    main()
