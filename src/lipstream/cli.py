"""`lipstream` command line. Each flag maps onto a function argument; user errors are one line."""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.panel import Panel

from lipstream.errors import InputError, LipStreamError, check_file
from lipstream.preflight import (
    RenderOptions, UsageError, check_models, check_output_path, check_program, fps_option, in_range, machine_defaults,
    random_size_for)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="LipStream: fast MuseTalk v1.5 lip-sync for AI presenters.")
weights_app = typer.Typer(no_args_is_help=True, help="Get, check or fake the MuseTalk v1.5 model files.")
app.add_typer(weights_app, name="weights")
err = Console(stderr=True)
# The click that typer runs on: typer >= 0.2x carries its own copy (typer._click), older typer imports click.
click = getattr(importlib.import_module("typer.core"), "_click", None) or importlib.import_module("click")
out = Console()

ModelsOpt = Annotated[Optional[Path], typer.Option(
    "--models", help="Models folder (upstream layout). Default: $LIPSTREAM_MODELS or ~/.cache/lipstream/models.")]
RandomOpt = Annotated[bool, typer.Option(
    "--random-weights", help="Use untrained, seeded random networks (speed tests only: no real mouth).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cuda, cpu, or auto (cuda when present).")]
RandomSizeOpt = Annotated[str, typer.Option(
    "--random-size", help="With --random-weights: 'full' (the real networks' size and cost), 'tiny' (CPU tests "
                          "and demos), or 'auto': render follows the avatar (the size it was compiled with), "
                          "otherwise tiny on a CPU and full on a GPU.")]


_IMPORTED = time.perf_counter()


def process_age() -> float:
    """Seconds since this process started (from /proc on Linux; elsewhere since this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


def warn_random_weights() -> None:
    from lipstream.models import RANDOM_WARNING

    err.print(Panel(RANDOM_WARNING, title="WARNING", style="bold red"))


def load_models(models, device: str, random_weights: bool, random_size: str, avatar_meta: dict | None = None,
                **kwargs):
    """The networks for a command: the warning first when they are random, then loaded on the chosen device."""
    from lipstream.models import load_musetalk
    from lipstream.startup import pick_device

    device = pick_device(device)
    size = random_size_for(random_size, device.type, avatar_meta)
    if random_weights:
        warn_random_weights()
        err.print(f"random networks: {size} size on {device}", highlight=False)
    return load_musetalk(models, device=device, random_weights=random_weights, size=size, warn=False, **kwargs)


@weights_app.command("download")
def weights_download(models: ModelsOpt = None,
                     force: Annotated[bool, typer.Option(help="Download again even if present.")] = False) -> None:
    """Fetch musetalkV15/, sd-vae/ and whisper/ from Hugging Face into the models folder."""
    from lipstream.models.download import download
    from lipstream.models.layout import models_dir

    root = models_dir(models)
    fetched = download(root, force=force, report=lambda s: err.print(s))
    out.print(f"{len(fetched)} files downloaded; models folder: {root}")


@weights_app.command("verify")
def weights_verify(models: ModelsOpt = None,
                   sha256: Annotated[bool, typer.Option(help="Also hash whole files (slow for unet.pth).")] = False
                   ) -> None:
    """Load every file of a models folder strictly and print what it holds."""
    from lipstream.models.verify import verify

    report = verify(models, sha256=sha256)
    out.print(f"models folder {report.root}")
    for row in report.rows:
        colour = "green" if row.status == "ok" else "red"
        out.print(f"[bold]{row.component:8}[/] [{colour}]{row.status}[/]  {row.file}  {row.size}  {row.format}",
                  highlight=False)
        if row.status == "ok":
            out.print(f"         {row.tensors} tensors, {row.parameters} parameters, {row.dtype}, "
                      f"fingerprint {row.fingerprint}", highlight=False)
        if row.detail:
            out.print(f"         {row.detail}", highlight=False, soft_wrap=True)
    if not report.ok:
        raise LipStreamError(f"{report.failures} of {len(report.rows)} components failed to load: {report.root}")


@weights_app.command("random")
def weights_random(folder: Annotated[Path, typer.Argument(help="Folder to write (upstream layout).")],
                   size: Annotated[str, typer.Option(help="full or tiny")] = "tiny",
                   seed: int = 0) -> None:
    """Write seeded random weights in the upstream layout (to test loading; NOT a real model)."""
    from lipstream.models.export import write_random_checkpoint

    warn_random_weights()
    write_random_checkpoint(folder, size=size, seed=seed)
    out.print(f"wrote random {size} weights to {folder}")


@app.command("compile")
def compile_cmd(inputs: Annotated[list[Path], typer.Argument(help="Videos or images (stills), or folders of them.")],
                output: Annotated[Path, typer.Option("-o", "--output", help="Avatars folder (one sub-folder per avatar).")],
                force: Annotated[bool, typer.Option(help="Compile again even if the input is unchanged.")] = False,
                track: Annotated[Optional[Path], typer.Option(
                    help="Precomputed landmarks or boxes (JSON) for one input, or a folder of <name>.track.json.")] = None,
                save_track: Annotated[Optional[Path], typer.Option(
                    help="Write the tracked landmarks to DIR/<name>.track.json.")] = None,
                extra_margin: Annotated[int, typer.Option(help="Pixels added below the chin (MuseTalk v1.5: 10).")] = 10,
                bbox_shift: Annotated[int, typer.Option(help="Move the box's centre line down (+) or up (-), px.")] = 0,
                fps: Annotated[Optional[str], typer.Option(help="Override the loop's frame rate (stills: 25).")] = None,
                models: ModelsOpt = None, random_weights: RandomOpt = False, random_size: RandomSizeOpt = "auto",
                device: DeviceOpt = "auto") -> None:
    """Compile action loops into avatars: face track, boxes, blend masks, VAE latents, source frames."""
    RenderOptions(device=device, random_size=random_size).check()
    fps_option(fps)
    in_range("--extra-margin", extra_margin, 0, 200, "pixels")
    in_range("--bbox-shift", bbox_shift, -200, 200, "pixels")
    for path in inputs:
        if not path.exists():
            raise InputError(path, "no such video, image or folder")
    if output.exists() and not output.is_dir():
        raise InputError(output, "is a file, expected the avatars folder")
    if track is not None and not track.exists():
        raise InputError(track, "no such track file or folder")
    check_models(models, random_weights)

    from rich.table import Table

    from lipstream.avatar import CompileOptions, compile_many

    m = load_models(models, device, random_weights, random_size, components=["vae"])
    results = compile_many(list(inputs), output, m.vae, m.fingerprints["vae"], track=track, save_track_dir=save_track,
                           options=CompileOptions(extra_margin, bbox_shift, fps=fps), force=force,
                           vae_random=m.config.name if m.random_weights else None)
    table = Table(title=f"avatars in {output}")
    for col in ("avatar", "status", "frames", "size", "fps", "face box", "time", "note"):
        table.add_column(col)
    colours = {"compiled": "green", "skipped": "cyan", "failed": "red"}
    for r in results:
        table.add_row(r.name, f"[{colours[r.status]}]{r.status}[/]", str(r.frames or ""),
                      f"{r.size[0]}x{r.size[1]}" if r.frames else "", r.fps,
                      f"{r.face[0]}x{r.face[1]}" if r.frames else "", f"{r.seconds:.1f} s" if r.seconds else "",
                      r.message)
    out.print(table)
    failed = [r for r in results if r.status == "failed"]
    if failed:
        raise LipStreamError(f"{len(failed)} of {len(results)} inputs failed: " + "; ".join(r.message for r in failed))


def _render(program, output: Path, avatars: Optional[Path], options: RenderOptions, reference: bool,
            compile: str, models, random_weights: bool, timings: bool = False) -> None:
    """Check everything a user typed (no torch yet: a mistake costs a fraction of a second), then render."""
    options.check()
    metas = check_program(program, avatars, output)
    check_models(models, random_weights)
    t_checked = process_age()

    import torch

    from lipstream.startup import load_networks, pick_device

    device = pick_device(options.device)
    t_torch = process_age()
    chosen = machine_defaults(device.type, os.cpu_count() or 1)
    batch, preset = options.batch or chosen["batch"], options.preset or chosen["preset"]
    encoders = options.encoders or chosen["encoders"]
    size = random_size_for(options.random_size, device.type, next(iter(metas.values())))
    if random_weights:
        warn_random_weights()
    nets = load_networks(models, device, random_weights, size, compile="off" if reference else compile,
                         decode_rows=options.decode_rows, dtype=torch.float32 if reference else None,
                         report=lambda line: err.print(line, highlight=False))
    from lipstream.render import render_program  # after the networks: its imports overlap nothing

    t_networks = process_age()
    where = f"{size} random networks" if random_weights else "networks"
    engine = "reference path" if reference else f"{nets.engine} engine"
    err.print(f"{engine}: {where} on {device}, batch {batch}, {encoders} x264 encoder{'s' * (encoders > 1)} "
              f"({preset}, crf {options.crf})", highlight=False)
    if nets.note:
        err.print(nets.note, highlight=False, soft_wrap=True)
    report = render_program(program, output, nets.models, avatars_dir=avatars, fps=options.fps, reference=reference,
                            batch_size=batch, crf=options.crf, preset=preset, encoders=encoders,
                            decode_rows=options.decode_rows)
    out.print(f"wrote {report.output}: {report.frames} frames at {report.fps} fps ({report.duration_s:.2f} s of audio) "
              f"in {report.wall_s:.2f} s = [bold]{report.render_fps:.1f} fps[/] "
              f"({report.render_fps / float(report.fps):.1f}x real time), first frame after {report.first_frame_s:.2f} s"
              + (" [reference path]" if reference else ""))
    age = process_age()  # what the user waited: imports, networks and set-up included
    started = age - report.wall_s
    out.print(f"process: {age:.2f} s so far, first encoded packet {started + report.first_frame_s:.2f} s "
              "after it started", highlight=False)
    if timings:
        _print_timings(report, nets, {"imports and checks": t_checked, "torch and the device": t_torch - t_checked,
                                      "networks": t_networks - t_torch, "render set-up": started - t_networks})
    if random_weights:
        out.print("[bold red]random weights: the mouth is noise, not speech[/]")


def _print_timings(report, nets, before: dict[str, float]) -> None:
    """--timings: where the process's time went, from its start to the finished MP4."""
    from rich.table import Table

    t = report.timings
    table = Table(title="start-up and render, seconds from the process start")
    for col in ("step", "seconds", "note"):
        table.add_column(col)
    notes = {"networks": f"{nets.engine} engine" + "".join(
        f", {k.removesuffix('_s')} {v:.2f} s" for k, v in nets.timings.items() if k != "networks_s")}
    for name, seconds in before.items():
        table.add_row(name, f"{seconds:.2f}", notes.get(name, ""))
    rows = [("audio: decode + Whisper features", t.get("audio_s")), ("avatars: load", t.get("load_s")),
            ("graph capture", t.get("warmup_s")),
            ("first encoded packet (after render start)", report.first_frame_s),
            ("frames (render loop)", report.wall_s - t.get("finish_s", 0.0) - sum(
                t.get(k, 0.0) for k in ("audio_s", "load_s", "warmup_s", "plan_s"))),
            ("flush: last segments, audio, faststart", t.get("finish_s"))]
    for name, seconds in rows:
        if seconds is not None:
            table.add_row(name, f"{seconds:.2f}", "")
    table.add_row("render_program total", f"{report.wall_s:.2f}", f"{report.frames} frames")
    err.print(table)


AvatarsOpt = Annotated[Optional[Path], typer.Option(
    "--avatars", help="Folder of compiled avatars (default: $LIPSTREAM_AVATARS or ./avatars).")]
CrfOpt = Annotated[int, typer.Option(help="x264 quality, 0-51 (0 = lossless, 18 = visually lossless, 23 = x264's default).")]
PresetOpt = Annotated[Optional[str], typer.Option(
    show_default=False, help="x264 preset: ultrafast, superfast, veryfast, faster, fast, medium, slow, slower, "
                             "veryslow. Default: ultrafast with a GPU (the engine outruns x264), veryfast on a CPU.")]
ReferenceOpt = Annotated[bool, typer.Option("--reference", help="Plain eager fp32 + numpy blending (for equivalence).")]
BatchOpt = Annotated[Optional[int], typer.Option(
    show_default=False, help="Frames per engine batch, 1-256. Default: 32 with a GPU, 16 on a CPU.")]
CompileOpt = Annotated[Optional[bool], typer.Option(
    "--compile/--no-compile", show_default=False,
    help="Default (neither): the compiled engine where `lipstream warmup` has built it on this CUDA machine, else "
         "the uncompiled one. --compile: build it first if missing (minutes, once). --no-compile: never.")]
TimingsOpt = Annotated[bool, typer.Option("--timings", help="Print where the time went: start-up steps and render.")]
BenchCompileOpt = Annotated[bool, typer.Option(
    "--compile", help="torch.compile the network step (CUDA; about a minute the first time, then cached on disk).")]


def _compile_choice(value: Optional[bool]) -> str:
    return {None: "auto", True: "on", False: "off"}[value]
DecodeRowsOpt = Annotated[str, typer.Option(
    help="'auto' (default): decode only the face rows the blend mask uses (+19% GPU core; approximate, 45.9 dB "
         "worst frame with random weights: check it with yours) for the avatars whose mask allows it, the whole "
         "face for the rest; 'full': always the whole face (exact); 'mask': refuse avatars whose mask starts "
         "too high.")]
EncodersOpt = Annotated[Optional[int], typer.Option(
    help="Parallel x264 segment encoders (default: one per 2 cores, at most 8; 1 below 8 cores).")]


def _avatars_dir(value: Optional[Path]) -> Optional[Path]:
    if value is not None:
        return value
    env = os.environ.get("LIPSTREAM_AVATARS")
    return Path(env) if env else Path("avatars")


FpsOpt = Annotated[Optional[str], typer.Option(
    help="Output frame rate, e.g. 25, 29.97 or 30000/1001 (default: the first avatar's).")]


@app.command("render")
def render_cmd(avatar: Annotated[str, typer.Option(help="Compiled avatar: a name in --avatars, or its folder.")],
               audio: Annotated[Path, typer.Option(help="Speech: any audio file, or a video with audio.")],
               output: Annotated[Path, typer.Option("-o", "--output", help="Output .mp4 (H.264 + AAC).")],
               avatars: AvatarsOpt = None,
               start_frame: Annotated[int, typer.Option(help="Where in its loop the avatar starts.")] = 0,
               fps: FpsOpt = None, crf: CrfOpt = 18, preset: PresetOpt = None, reference: ReferenceOpt = False,
               batch: BatchOpt = None, encoders: EncodersOpt = None, compile: CompileOpt = None,
               decode_rows: DecodeRowsOpt = "auto", models: ModelsOpt = None, random_weights: RandomOpt = False,
               random_size: RandomSizeOpt = "auto", device: DeviceOpt = "auto", timings: TimingsOpt = False) -> None:
    """Make an avatar speak an audio file: one lip-synced MP4."""
    from lipstream.script import single_scene

    options = RenderOptions(fps_option(fps), crf, preset, batch, encoders, decode_rows, start_frame, device,
                            random_size)
    _render(single_scene(avatar, audio, start_frame), output, _avatars_dir(avatars), options, reference,
            _compile_choice(compile), models, random_weights, timings)


@app.command("broadcast")
def broadcast_cmd(script: Annotated[Path, typer.Argument(help="YAML: scenes of avatar + audio, cuts, crossfades.")],
                  output: Annotated[Path, typer.Option("-o", "--output", help="Output .mp4 (H.264 + AAC).")],
                  avatars: AvatarsOpt = None, fps: FpsOpt = None, crf: CrfOpt = 18, preset: PresetOpt = None,
                  reference: ReferenceOpt = False, batch: BatchOpt = None, encoders: EncodersOpt = None,
                  compile: CompileOpt = None, decode_rows: DecodeRowsOpt = "auto", models: ModelsOpt = None,
                  random_weights: RandomOpt = False, random_size: RandomSizeOpt = "auto",
                  device: DeviceOpt = "auto", timings: TimingsOpt = False) -> None:
    """Render a multi-scene script (several presenters, camera cuts) into one continuous MP4."""
    from lipstream.script import load_script

    options = RenderOptions(fps_option(fps), crf, preset, batch, encoders, decode_rows, 0, device, random_size)
    _render(load_script(script), output, _avatars_dir(avatars), options, reference, _compile_choice(compile), models,
            random_weights, timings)


@app.command("warmup")
def warmup_cmd(models: ModelsOpt = None, random_weights: RandomOpt = False,
               random_size: Annotated[str, typer.Option(
                   "--random-size", help="With --random-weights: full or tiny (auto: tiny on a CPU, full on a GPU).")]
               = "auto",
               decode_rows: DecodeRowsOpt = "auto", device: DeviceOpt = "auto",
               force: Annotated[bool, typer.Option(help="Build again even if cached.")] = False) -> None:
    """Build the compiled engine for this machine ahead of time (in a container build, or at provisioning).

    Writes AOTInductor packages and the weights they read to the cache folder ($LIPSTREAM_CACHE,
    default ~/.cache/lipstream/aot); renders then load them in about a second. Safe to delete.
    """
    RenderOptions(device=device, random_size=random_size, decode_rows=decode_rows).check()
    check_models(models, random_weights)

    from lipstream.startup import KINDS_FOR_ROWS, pick_device, warmup

    dev = pick_device(device)
    size = random_size_for(random_size, dev.type)
    if random_weights:
        warn_random_weights()
    t0 = time.perf_counter()
    built = warmup(models, dev, random_weights, size, kinds=KINDS_FOR_ROWS[decode_rows], force=force,
                   report=lambda line: err.print(line, highlight=False, soft_wrap=True))
    failed = [b for b in built if b.status == "failed"]
    out.print(f"compiled engine for {dev}: {sum(b.status == 'built' for b in built)} built, "
              f"{sum(b.status == 'cached' for b in built)} already cached, {len(failed)} failed, "
              f"{time.perf_counter() - t0:.1f} s", highlight=False)
    if failed:
        raise LipStreamError("could not compile: " + "; ".join(f"{b.kind}: {b.message}" for b in failed)
                             + " (renders use the uncompiled engine for these)")


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
              = "full", compile_vae: BenchCompileOpt = False,
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
    RenderOptions(device=device, random_size=random_size).check()
    random_weights = weights == "random"
    check_models(None if random_weights else Path(weights), random_weights)

    from rich.table import Table

    from lipstream.bench.run import HEADER, cells, run

    m = load_models(None if random_weights else weights, device, random_weights, random_size)
    report = run(m, out_dir, width=width, height=height, scale=scale,
                 modes=tuple(x.strip() for x in modes.split(",") if x.strip()), compile_vae=compile_vae,
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
                   live_preset: Annotated[str, typer.Option("--preset", help="Live options preset: "
                                                            "realtime, accurate, utterance, cpu.")] = "realtime",
                   compile: Annotated[str, typer.Option(help="off, vae or all (Inductor; the largest bucket only).")]
                   = "auto",
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

    if live_preset not in PRESETS:
        raise UsageError(f"--preset {live_preset!r}: expected one of {', '.join(PRESETS)}")
    if compile not in ("auto", "off", "vae", "all"):
        raise UsageError(f"--compile {compile!r}: expected auto, off, vae or all")
    RenderOptions(device=device, random_size=random_size).check()
    check_models(models, random_weights)

    from lipstream.bench.live import largest, run

    m = load_models(models, device, random_weights, random_size)
    compile = ("all" if m.device.type == "cuda" else "off") if compile == "auto" else compile
    report = run(m, out_dir, sizes=sizes, counts=counts, fps=fps, seconds=seconds, options=live_preset,
                 compile=compile, command=" ".join(["lipstream", *sys.argv[1:]]), progress=out.print)
    for w, h in sizes:
        out.print(f"{w}x{h}: largest N at p99 <= 250 ms with no frame late: {largest(report, f'{w}x{h}')}")
    out.print(f"report: {out_dir / 'live_bench.md'}")


@app.command("serve")
def serve_cmd(avatars: Annotated[Path, typer.Option(help="Folder of compiled avatars: every one is kept resident.")],
              host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
              port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
              data: Annotated[Path, typer.Option(help="Where jobs, uploads and results are kept.")] = Path("lipstream-data"),
              api_key: Annotated[Optional[list[str]], typer.Option(
                  "--api-key", help="A bearer key clients must send (repeatable; or LIPSTREAM_API_KEYS, comma-"
                                    "separated). Without any, only a loopback --host is allowed.")] = None,
              max_upload_mb: Annotated[float, typer.Option(help="Largest upload.")] = 50.0,
              max_audio_s: Annotated[float, typer.Option(help="Longest audio of a job.")] = 600.0,
              jobs_per_key: Annotated[int, typer.Option(help="Queued + running jobs a key may have.")] = 8,
              sessions_per_key: Annotated[int, typer.Option(help="Live sessions a key (or, without keys, all "
                                                                 "clients) may have open.")] = 4,
              capacity_fps: Annotated[Optional[float], typer.Option(
                  help="Frames/s live sessions may take in all (default: what the engine measures at start).")] = None,
              live_preset: Annotated[str, typer.Option("--preset", help="Live options preset: realtime (plays 250 ms "
                                                       "behind the speech), accurate (350 ms), utterance (1 s), cpu (1 s, "
                                                       "Whisper every 200 ms: a machine without a GPU).")]
              = "realtime",
              playout_delay_ms: Annotated[Optional[float], typer.Option(
                  help="How far behind the speech live sessions play (default: the preset's): less is less "
                       "latency at the client and more frames late when the engine is busy.")] = None,
              switch_interval_ms: Annotated[float, typer.Option(
                  help="The GIL switch interval while serving: how soon the engine's core thread gets the "
                       "interpreter back from the event loop (Python's default: 5).")] = 0.5,
              rtc_workers: Annotated[Optional[int], typer.Option(
                  help="Processes the sessions' WebRTC (aiortc) runs in, off the engine's GIL (default: one per "
                       "4 cores, 1 to 8).")] = None,
              compile: Annotated[str, typer.Option(help="off, vae or all (Inductor for the live steps).")] = "auto",
              models: ModelsOpt = None, random_weights: RandomOpt = False,
              random_size: RandomSizeOpt = "auto", device: DeviceOpt = "auto") -> None:
    """Keep the networks, the compiled steps and the avatars resident; serve render jobs over HTTP."""
    from lipstream.serve.options import ServeOptions

    keys = tuple(api_key or ()) + tuple(k.strip() for k in os.environ.get("LIPSTREAM_API_KEYS", "").split(",")
                                        if k.strip())
    options = ServeOptions(avatars.expanduser(), data.expanduser(), host, port, keys, max_upload_mb, max_audio_s,
                           jobs_per_key, sessions_per_key, live_preset=live_preset, live_capacity_fps=capacity_fps,
                           playout_delay_s=None if playout_delay_ms is None else playout_delay_ms / 1000,
                           switch_interval_ms=switch_interval_ms, rtc_workers=rtc_workers)
    try:
        options.check()
    except ValueError as e:
        raise UsageError(str(e)) from None
    if compile not in ("auto", "off", "vae", "all"):
        raise UsageError(f"--compile {compile!r}: expected auto, off, vae or all")
    RenderOptions(device=device, random_size=random_size).check()
    check_models(models, random_weights)

    from lipstream.serve.server import json_logs, serve

    json_logs(os.environ.get("LIPSTREAM_LOG", "INFO"))
    m = load_models(models, device, random_weights, random_size)
    serve(options, m, compile=("all" if m.device.type == "cuda" else "off") if compile == "auto" else compile)


@app.command("serve-bench")
def serve_bench_cmd(url: Annotated[str, typer.Option(help="A running `lipstream serve`.")] = "http://127.0.0.1:8000",
                    out_dir: Annotated[Path, typer.Option("-o", "--output", help="Report folder.")] = Path("serve-bench-out"),
                    sessions: Annotated[str, typer.Option(help="Comma-separated session counts to run.")] = "4,8,16",
                    seconds: Annotated[float, typer.Option(help="Length of each row.")] = 12.0,
                    avatar: Annotated[Optional[list[str]], typer.Option(
                        help="Avatars the sessions use, in turn (repeatable; default: every resident one).")] = None,
                    render_audio: Annotated[Optional[Path], typer.Option(
                        help="Also submit a render job of this audio at the start of each row.")] = None,
                    server_pid: Annotated[Optional[int], typer.Option(help="The server's process id, to report "
                                                                           "its CPU (same machine only).")] = None,
                    warmup: Annotated[bool, typer.Option(help="A short unreported row at the largest N first.")] = True,
                    codec: Annotated[str, typer.Option(help="Video codec the clients offer: any (aiortc's list; the "
                                                            "server then sends H.264), h264 or vp8.")] = "any",
                    chunk_ms: Annotated[float, typer.Option(help="Speech goes out in chunks of this length.")] = 20.0,
                    playout_delay_ms: Annotated[Optional[str], typer.Option(
                        help="Comma-separated playout delays the sessions ask for, each a set of rows "
                             "(default: the server's).")] = None,
                    ) -> None:
    """Load-test a server with real clients: N aiortc viewers in their own processes speak over the socket."""
    try:
        counts = [int(v) for v in sessions.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--sessions {sessions!r}: expected e.g. 4,8,16") from None
    if not counts or min(counts) < 1 or max(counts) > 128:
        raise UsageError(f"--sessions {sessions!r}: expected counts from 1 to 128")
    if not 4 <= seconds <= 600:
        raise UsageError(f"--seconds {seconds}: expected 4 to 600")
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--url {url!r}: expected http://HOST:PORT")
    if codec not in ("any", "h264", "vp8"):
        raise UsageError(f"--codec {codec!r}: expected any, h264 or vp8")
    in_range("--chunk-ms", chunk_ms, 10, 1000, "milliseconds")
    try:
        delays = [float(v) for v in playout_delay_ms.split(",") if v.strip()] if playout_delay_ms else [None]
    except ValueError:
        raise UsageError(f"--playout-delay-ms {playout_delay_ms!r}: expected e.g. 200,250") from None
    if not delays or any(d is not None and not 50 <= d <= 5000 for d in delays):
        raise UsageError(f"--playout-delay-ms {playout_delay_ms!r}: 50 to 5000 ms each")
    if render_audio is not None:
        check_file(render_audio, "audio file")
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(out_dir, "is a file, expected the report folder")

    from lipstream.bench.serve_load import run, write

    key = next((k.strip() for k in os.environ.get("LIPSTREAM_API_KEYS", "").split(",") if k.strip()), "")
    try:
        report = run(url.rstrip("/"), key, counts, seconds, avatar, render_audio=render_audio, server_pid=server_pid,
                     warmup=warmup, codec=codec, chunk_ms=chunk_ms, playout_delays_ms=delays, command=" ".join(["lipstream", *sys.argv[1:]]), progress=out.print)
    except (RuntimeError, OSError) as e:
        raise LipStreamError(f"--url {url}: {e}") from None
    write(report, out_dir)
    out.print(f"largest N at p99 <= 250 ms with no frame late: {report['largest_n']}")
    out.print(f"report: {out_dir / 'serve_bench.md'}")


@app.command("features")
def features(audio: Annotated[Path, typer.Argument(help="Audio file, or a video with an audio track.")],
             fps: Annotated[str, typer.Option(help="Video frame rate the windows align to (25, 29.97, 30000/1001).")] = "25",
             output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Save features + windows (.safetensors).")] = None,
             models: ModelsOpt = None, random_weights: RandomOpt = False, random_size: RandomSizeOpt = "auto",
             device: DeviceOpt = "auto") -> None:
    """Decode speech, compute Whisper features and per-frame audio windows; print shapes and timings."""
    rate = fps_option(fps)
    RenderOptions(device=device, random_size=random_size).check()
    check_file(audio, "audio file")
    if output is not None:
        check_output_path(output)
    check_models(models, random_weights)

    from lipstream.audio import prepare_speech

    m = load_models(models, device, random_weights, random_size, components=["whisper"])
    speech = prepare_speech(audio, rate, m.whisper, m.feature_extractor)
    out.print(f"{audio}: {speech.duration:.3f} s -> {speech.frames} frames at {speech.fps} fps; "
              f"features {tuple(speech.features.shape)}, windows {tuple(speech.windows.shape)} on {m.device}")
    out.print("  " + ", ".join(f"{k} {v:.1f} ms" for k, v in speech.timings_ms.items()))
    if output is not None:
        from lipstream.io import save_safetensors_atomic

        save_safetensors_atomic(output, {"features": speech.features, "windows": speech.windows},
                                {"fps": str(speech.fps), "samples": str(speech.samples.numel()),
                                 "weights": m.source, **{f"fingerprint.{k}": v for k, v in m.fingerprints.items()}})
        out.print(f"wrote {output}")


def main(argv: list[str] | None = None) -> int:
    """Run one command; every error a user can cause ends in one line: exit 1, or 2 for usage, 130 for Ctrl-C."""
    logging.basicConfig(level=os.environ.get("LIPSTREAM_LOG", "WARNING"), format="%(levelname)s %(name)s: %(message)s")
    try:
        # standalone_mode=False: click's usage errors come here (one line) instead of a multi-line panel;
        # typer turns a KeyboardInterrupt into the return value 130.
        code = app(args=argv, prog_name="lipstream", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:
        click.echo(e.ctx.get_help(), err=True)
        return 2
    except click.exceptions.UsageError as e:
        command = e.ctx.command_path if e.ctx else "lipstream"
        err.print(f"[bold red]error:[/] {e.format_message()} (see `{command} --help`)", highlight=False, soft_wrap=True)
        return 2
    except UsageError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        return e.exit_code
    except LipStreamError as e:
        err.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
        return 1
    except (KeyboardInterrupt, click.exceptions.Abort):
        code = 130
    if code == 130:
        err.print("interrupted: stopped, no output written", highlight=False)
    return code if isinstance(code, int) else 0


def entry() -> None:
    """The `lipstream` program. After Ctrl-C the output is already cleaned up, so the process ends at once:
    tearing down torch (and a CUDA context) took seconds more, and Ctrl-C must stop within one."""
    code = main()
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
