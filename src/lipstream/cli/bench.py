"""`lipstream bench | live-bench`: the offline and live benchmarks, each a written report."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from lipstream.cli.common import (
    CompileOpt, DeviceOpt, LivePresetOpt, ModelsOpt, OldPresetOpt, RandomOpt, RandomSizeOpt, app, compile_choice,
    load_models, out, renamed)
from lipstream.errors import UsageError
from lipstream.cli.checks import check_models, in_range, machine_options


@app.command("bench")
def bench_cmd(out_dir: Annotated[Path, typer.Option("-o", "--output", help="Report folder.")] = Path("bench-out"),
              size: Annotated[str, typer.Option(help="Frame size WxH of the generated avatars.")] = "1920x1080",
              scale: Annotated[float, typer.Option(help="Shorten every scenario (smoke runs).")] = 1.0,
              modes: Annotated[str, typer.Option(
                  help="Comma-separated: legacy, fast, ablation (fast with each optimisation off in turn), oneshot "
                       "(a fresh `lipstream broadcast` process per run, cold and warm: what a user waits for).")]
              = "legacy,fast,ablation,oneshot",
              weights: Annotated[str, typer.Option(help="'random' or a models folder.")] = "random",
              random_size: Annotated[str, typer.Option(
                  "--random-size", help="With --weights random: 'full' (default: the real cost) or 'tiny'.")]
              = "full", compile: CompileOpt = None,
              device: DeviceOpt = "auto",
              scenarios: Annotated[str, typer.Option(
                  help="Comma-separated subset (A, B); the other scenarios' rows already in the report folder "
                       "are kept, so a long bench can be split across runs.")] = "") -> None:
    """Scenario A (3-presenter broadcast, 12 s) and B (25.8 s monologue): legacy vs fast, one report."""
    try:
        width, height = (int(v) for v in size.lower().split("x"))
    except ValueError:
        raise UsageError(f"--size {size!r}: expected WIDTHxHEIGHT, e.g. 1920x1080") from None
    in_range("--size", min(width, height), 64, 4096, "a frame side in pixels")
    if not 0 < scale <= 1:
        raise UsageError(f"--scale {scale}: expected a fraction above 0 and at most 1")
    picked = {x.strip() for x in modes.split(",") if x.strip()}
    if not picked or picked - {"legacy", "fast", "ablation", "oneshot"}:
        raise UsageError(f"--modes {modes!r}: expected a comma-separated subset of legacy, fast, ablation, oneshot")
    if {x.strip().upper() for x in scenarios.split(",") if x.strip()} - {"A", "B"}:
        raise UsageError(f"--scenarios {scenarios!r}: expected A, B or A,B")
    machine_options(device, random_size)
    random_weights = weights == "random"
    check_models(None if random_weights else Path(weights), random_weights)

    from rich.table import Table

    from lipstream.bench.run import HEADER, cells, run

    m = load_models(None if random_weights else weights, device, random_weights, random_size)
    report = run(m, out_dir, width=width, height=height, scale=scale,
                 modes=tuple(x.strip() for x in modes.split(",") if x.strip()),
                 compile={"on": True, "off": False, "auto": m.device.type == "cuda"}[compile_choice(compile)],
                 only=tuple(x.strip().upper() for x in scenarios.split(",") if x.strip()) or None,
                 command=" ".join(["lipstream", *sys.argv[1:]]))
    table = Table(title=f"LipStream bench: {report['device']}, {report['size']}")
    for col in HEADER:
        table.add_column(col)
    for row in report["rows"]:
        table.add_row(*cells(row))
    out.print(table)
    out.print(f"report: {out_dir / 'bench.json'}, {out_dir / 'bench.md'}")


@app.command("live-bench")
def live_bench_cmd(out_dir: Annotated[Path, typer.Option("-o", "--output", help="Report folder.")] = Path("live-bench-out"),
                   sessions: Annotated[str, typer.Option(help="Comma-separated session counts to run.")] = "8,16,24",
                   size: Annotated[str, typer.Option(help="Comma-separated frame sizes WxH.")] = "1280x720",
                   fps: Annotated[int, typer.Option(help="Frame rate of every session.")] = 25,
                   seconds: Annotated[float, typer.Option(help="Length of each run.")] = 20.0,
                   live_preset: LivePresetOpt = "realtime", preset: OldPresetOpt = None,
                   compile: CompileOpt = None,
                   models: ModelsOpt = None, random_weights: RandomOpt = False,
                   random_size: RandomSizeOpt = "auto", device: DeviceOpt = "auto") -> None:
    """N live sessions fed speech in real time, with encode: latency p50/p95/p99, frames late, GPU and CPU load."""
    try:
        counts = [int(v) for v in sessions.split(",") if v.strip()]
        from lipstream.bench.live import parse_sizes

        sizes = parse_sizes(size)
    except ValueError:
        raise UsageError(f"--sessions {sessions!r} / --size {size!r}: expected e.g. 8,16,24 and 1280x720,1920x1080") from None
    if not counts or min(counts) < 1 or max(counts) > 256:
        raise UsageError(f"--sessions {sessions!r}: expected counts from 1 to 256")
    for w, h in sizes:
        in_range("--size", min(w, h), 64, 4096, "a frame side in pixels")
    in_range("--fps", fps, 1, 60, "frames per second")
    if not 2 <= seconds <= 600:
        raise UsageError(f"--seconds {seconds}: expected 2 to 600")
    from lipstream.live.options import PRESETS

    live_preset = renamed("--preset", "--live-preset", preset, live_preset, "realtime")
    if live_preset not in PRESETS:
        raise UsageError(f"--live-preset {live_preset!r}: expected one of {', '.join(PRESETS)}")
    machine_options(device, random_size)
    check_models(models, random_weights)

    from lipstream.bench.live import largest, run

    from lipstream.engine.engines import FAST_INDUCTOR

    m = load_models(models, device, random_weights, random_size)
    choice = compile_choice(compile)
    inductor = FAST_INDUCTOR if choice == "on" or (choice == "auto" and m.device.type == "cuda") else "off"
    report = run(m, out_dir, sizes=sizes, counts=counts, fps=fps, seconds=seconds, options=live_preset,
                 compile=inductor, command=" ".join(["lipstream", *sys.argv[1:]]), progress=out.print)
    for w, h in sizes:
        out.print(f"{w}x{h}: largest N at p99 <= 250 ms with no frame late: {largest(report, f'{w}x{h}')}")
    out.print(f"report: {out_dir / 'live_bench.md'}")
