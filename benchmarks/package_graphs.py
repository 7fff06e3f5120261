"""Do CUDA graphs pay for themselves on the compiled packages in a one-shot render? (issue 28)

A warm `lipstream render` on the packages spends 1.0-1.3 s capturing the first batch's bucket before its
first frame, and 0.5 s capturing the full bucket in the render loop (BENCHMARKS.md, 9a38504), while an
AOTInductor package launches its kernels from C++, without Python between them. This measures, each mode
in fresh processes (a process's first call pays CUDA's lazy module loading, cuBLAS and cuDNN once):

- `graphs`: what a render does now: capture bucket `first_batch`, render it, capture the full bucket,
  render it; then `--batches` full batches back to back;
- `eager`: the same calls with graphs off (`EngineOptions.graphs=False`: the package called directly).

Each row: the networks' load, the first batch (its capture included) to its frames on the device, the
first full batch likewise, and the steady rate over the full batches (GPU work only: no encode).
With `--audio`, two more modes render that speech to an MP4 in-process (`render_program`, default options
but `EngineOptions.capture`): `render:before` (the default: the first bucket captured before the first
frame) and `render:later` (the first batch uncaptured, every bucket captured in the loop): render seconds
and first packet.

    LIPSTREAM_CACHE=DIR python benchmarks/package_graphs.py --avatar AVATAR_FOLDER [--runs 2] [--out DIR]
AVATAR_FOLDER: a compiled avatar (benchmarks/user_render.py's DIR/work/avatars/anchor); the packages in
LIPSTREAM_CACHE (`lipstream warmup --random-weights`). `--device cpu --size tiny` checks the script here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = ("graphs", "eager")
RENDER_MODES = ("render:before", "render:later")


def render_row(mode: str, avatar: str, audio: str, device_name: str, size: str) -> dict:
    import tempfile

    import torch

    from lipstream.options import RenderOptions
    from lipstream.render import render_program
    from lipstream.script import single_scene
    from lipstream.startup import load_networks

    t0 = time.perf_counter()
    nets = load_networks(None, torch.device(device_name), True, size, compile="auto")
    t_nets = time.perf_counter() - t0
    options = RenderOptions(avatars_dir=Path(avatar).parent, progress=False)
    options = options.for_machine(torch.device(device_name).type, os.cpu_count() or 1)
    options = options.replace(engine=options.engine.replace(capture=mode.split(":")[1]))
    with tempfile.TemporaryDirectory() as tmp:
        report = render_program(single_scene(Path(avatar).name, Path(audio)), Path(tmp) / "out.mp4", nets.models, options)
    return {"mode": mode, "engine": nets.engine, "networks_s": round(t_nets, 3), "render_s": round(report.wall_s, 3),
            "first_packet_s": round(report.first_frame_s, 3), "frames": report.frames,
            "capture_before_s": round(report.timings.get("warmup_s", 0.0), 3),
            "capture_in_loop_s": round(report.timings.get("warmup_later_s", 0.0), 3)}


def one(mode: str, avatar: str, device_name: str, size: str, batches: int) -> dict:
    t0 = time.perf_counter()
    import torch

    from lipstream.avatar import load_avatar
    from lipstream.engine.build import make_engine
    from lipstream.engine.interface import FrameRequest
    from lipstream.options import RenderOptions
    from lipstream.startup import load_networks

    device = torch.device(device_name)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    nets = load_networks(None, device, True, size, compile="auto")
    options = RenderOptions().for_machine(device.type, os.cpu_count() or 1).engine
    if mode == "eager":
        options = options.replace(graphs=False)
    engine = make_engine(nets.models, options)
    a = engine.add_avatar(load_avatar(avatar, device, vae_fingerprint=nets.models.fingerprints.get("vae")))
    frames = engine.avatars[a].latents.shape[0]
    gen = torch.Generator().manual_seed(0)
    windows = torch.randn(64, 50, 384, generator=gen).to(device, nets.models.dtype)
    requests = [FrameRequest(a, i % frames, windows[i % 64]) for i in range(4096)]
    sync()
    t_ready = time.perf_counter()
    first, full = engine.buckets[0], engine.buckets[-1]
    row = {"mode": mode, "engine": nets.engine, "buckets": list(engine.buckets), "graphs": engine.use_graphs,
           "networks_s": round(t_ready - t0, 3)}
    t = time.perf_counter()
    engine.warm_up((first,))
    engine.render(requests[:first])
    sync()
    row["first_batch_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    engine.warm_up()
    engine.render(requests[first:first + full])
    sync()
    row["first_full_batch_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    for k in range(batches):
        s = (first + full * (k + 1)) % (len(requests) - full)
        engine.render(requests[s:s + full])
    sync()
    seconds = time.perf_counter() - t
    row["steady_fps"] = round(batches * full / seconds, 1)
    row["launch_ms_per_batch"] = None
    if device.type == "cuda":  # the CPU's share of a batch: the calls alone, the GPU not waited for
        t = time.perf_counter()
        for k in range(8):
            engine.render(requests[k * full:(k + 1) * full])
        row["launch_ms_per_batch"] = round((time.perf_counter() - t) / 8 * 1000, 2)
        sync()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--avatar", required=True, help="a compiled avatar's folder")
    p.add_argument("--runs", type=int, default=2, help="fresh processes per mode (alternating)")
    p.add_argument("--batches", type=int, default=24, help="full batches for the steady rate")
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="full", help="the random networks' size (tiny: a CPU check)")
    p.add_argument("--out", type=Path, default=None, help="write package_graphs.json and .md here")
    p.add_argument("--audio", default=None, help="speech for the render:before / render:later rows")
    p.add_argument("--one", choices=MODES + RENDER_MODES, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        row = (render_row(a.one, a.avatar, a.audio, a.device, a.size) if a.one in RENDER_MODES
               else one(a.one, a.avatar, a.device, a.size, a.batches))
        print(json.dumps(row), flush=True)
        return
    rows = []
    modes = MODES + (RENDER_MODES if a.audio else ())
    for run in range(a.runs):
        for mode in modes:
            r = subprocess.run([sys.executable, __file__, "--one", mode, "--avatar", a.avatar, "--device", a.device,
                                "--size", a.size, "--batches", str(a.batches)] + (["--audio", a.audio] if a.audio else []),
                               capture_output=True, text=True)
            line = next((x for x in reversed(r.stdout.splitlines()) if x.startswith("{")), None)
            if r.returncode or line is None:
                print(f"{mode} run {run}: rc {r.returncode}\n{r.stderr[-1500:]}", flush=True)
                continue
            rows.append({"run": run, **json.loads(line)})
            print(line, flush=True)
    lines = []
    for group, keys in ((MODES, ("networks_s", "first_batch_s", "first_full_batch_s", "steady_fps",
                                 "launch_ms_per_batch")),
                        (RENDER_MODES, ("networks_s", "render_s", "first_packet_s", "capture_before_s",
                                        "capture_in_loop_s"))):
        table = ["| mode | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
        for mode in group:
            mine = [r for r in rows if r["mode"] == mode]
            if mine:
                med = [statistics.median(r[k] for r in mine) if mine[0][k] is not None else None for k in keys]
                table.append(f"| {mode} (median of {len(mine)}) | " + " | ".join(str(m) for m in med) + " |")
        if len(table) > 2:
            lines += table + [""]
    print("\n".join(lines))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "package_graphs.json").write_text(json.dumps(rows, indent=1))
        (a.out / "package_graphs.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
