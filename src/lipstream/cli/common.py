"""What every `lipstream` command shares: the typer app, the consoles, the option types, the model loader.

No torch here or in any command module's top level: a mistake on the command line costs a fraction of a
second (the heavy imports happen inside a command, after its checks).
"""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.panel import Panel

from lipstream.preflight import random_size_for

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
DecodeRowsOpt = Annotated[str, typer.Option(
    help="'auto' (default): decode only the face rows the blend mask uses (+19% GPU core; approximate, 45.9 dB "
         "worst frame with random weights: check it with yours) for the avatars whose mask allows it, the whole "
         "face for the rest; 'full': always the whole face (exact); 'mask': refuse avatars whose mask starts "
         "too high.")]
EncodersOpt = Annotated[Optional[int], typer.Option(
    help="Parallel x264 segment encoders (default: one per 2 cores, at most 8; 1 below 8 cores).")]
FpsOpt = Annotated[Optional[str], typer.Option(
    help="Output frame rate, e.g. 25, 29.97 or 30000/1001 (default: the first avatar's).")]


def compile_choice(value: Optional[bool]) -> str:
    """--compile/--no-compile/neither as the engine's choice."""
    return {None: "auto", True: "on", False: "off"}[value]


def avatars_dir(value: Optional[Path]) -> Optional[Path]:
    """--avatars, else $LIPSTREAM_AVATARS, else ./avatars."""
    if value is not None:
        return value
    env = os.environ.get("LIPSTREAM_AVATARS")
    return Path(env) if env else Path("avatars")


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
