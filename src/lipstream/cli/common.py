"""What every `lipstream` command shares: the typer app, the consoles, the option types, the model loader.

No torch here or in any command module's top level: a mistake on the command line costs a fraction of a
second (the heavy imports happen inside a command, after its checks).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.panel import Panel

from lipstream.errors import UsageError
from lipstream.models.config import random_size_for

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
X264PresetOpt = Annotated[Optional[str], typer.Option(
    "--x264-preset", show_default=False,
    help="x264 preset: ultrafast, superfast, veryfast, faster, fast, medium, slow, slower, veryslow. Default: "
         "ultrafast with a GPU (the engine outruns x264), veryfast on a CPU.")]
LivePresetOpt = Annotated[str, typer.Option(
    "--live-preset", help="Live options preset: realtime (plays 250 ms behind the speech), lowlatency (120 ms, "
                          "each frame once its own audio is in), accurate (350 ms), utterance (1 s), cpu (1 s, "
                          "Whisper every 200 ms: a machine without a GPU).")]
OldPresetOpt = Annotated[Optional[str], typer.Option("--preset", hidden=True, help="Deprecated spelling.")]
ReferenceOpt = Annotated[bool, typer.Option("--reference", help="Plain eager fp32 + numpy blending (for equivalence).")]
ModelOpt = Annotated[str, typer.Option(
    "--model", help="musetalk (real time, a 256x256 face) or keysync (a 512x512 face: keyframes, then the frames "
                    "between; slower, sharper; `lipstream weights download --model keysync`).")]
KeySyncPresetOpt = Annotated[str, typer.Option(
    "--keysync-preset", help="With --model keysync: reference (its own precision: keyframes in fp32, the frames "
                             "between in fp16), fast (both, and the VAE's decoder, in bf16, the weights cast once) or draft (fast's precision, 6 steps, "
                             "the last two unguided: 14 UNet passes a frame against 33; not the reference's maths).")]
BatchOpt = Annotated[Optional[int], typer.Option(
    show_default=False, help="Frames per engine batch, 1-256. Default: 32 with a GPU, 16 on a CPU.")]
CompileOpt = Annotated[Optional[bool], typer.Option(
    "--compile/--no-compile", show_default=False,
    help="Compiled network code. Default (neither): where it is ready on a GPU (render, broadcast: the packages "
         "`lipstream warmup` built; serve: those packages, else Inductor, cached on disk; live-bench, bench: "
         "Inductor), else none. --compile: "
         "always (render builds missing packages first: minutes, once). --no-compile: never.")]
TimingsOpt = Annotated[bool, typer.Option("--timings", help="Print where the time went: start-up steps and render.")]
DecodeRowsOpt = Annotated[str, typer.Option(
    help="'auto' (default): decode only the face rows the blend mask uses (+19% GPU core; approximate, 45.9 dB "
         "worst frame with random weights: check it with yours) for the avatars whose mask allows it, the whole "
         "face for the rest; 'full': always the whole face (exact); 'mask': refuse avatars whose mask starts "
         "too high.")]
EncodersOpt = Annotated[Optional[int], typer.Option(
    help="Parallel x264 segment encoders (default: one per 2 cores, at most 8; 1 below 8 cores).")]
EncoderProcessesOpt = Annotated[Optional[bool], typer.Option(
    "--encoder-processes/--encoder-threads", show_default=False,
    help="Run the segment encoders as worker processes (frames through shared memory: the default on a GPU, "
         "where in threads their Python held back the render) or as threads (the default on a CPU).")]
FpsOpt = Annotated[Optional[str], typer.Option(
    help="Output frame rate, e.g. 25, 29.97 or 30000/1001 (default: the first avatar's).")]
ServerOpt = Annotated[Optional[str], typer.Option(
    "--server", envvar="LIPSTREAM_SERVER", show_default=False,
    help="Render on a running `lipstream serve` at this address (http://HOST:PORT) instead of here: the audio "
         "is uploaded, the avatar is one of the server's, the MP4 comes back to -o. Default: $LIPSTREAM_SERVER "
         "(--server '' renders here).")]
ServerKeyOpt = Annotated[Optional[str], typer.Option(
    "--api-key", envvar="LIPSTREAM_API_KEY", show_default=False,
    help="With --server: the server's bearer key (default: $LIPSTREAM_API_KEY, which keeps it out of `ps`).")]


def compile_choice(value: Optional[bool]) -> str:
    """--compile/--no-compile/neither as the commands' one choice: on, off or auto."""
    return {None: "auto", True: "on", False: "off"}[value]


def renamed(old: str, new: str, old_value, new_value, default=None):
    """The value of a renamed option: the new spelling's, or the old one's with a warning (kept one release)."""
    if old_value is None:
        return new_value
    if new_value != default:
        raise UsageError(f"{old} and {new}: give {new} only ({old} is its old name)")
    err.print(f"[yellow]warning:[/] {old} is deprecated and goes in the next release: use {new}", highlight=False)
    return old_value


# Spellings of earlier releases, rewritten before parsing, with a warning: kept for one release.
# serve and live-bench took `--compile off|vae|all|auto`; every command now has --compile/--no-compile.
OLD_COMPILE_VALUES = {"off": ["--no-compile"], "all": ["--compile"], "vae": ["--compile"], "auto": []}


def old_spellings(argv: list[str]) -> list[str]:
    """argv with the old spellings of options replaced by the new ones (a warning for each)."""
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        value = token.split("=", 1)[1] if token.startswith("--compile=") else (
            argv[i + 1] if token == "--compile" and i + 1 < len(argv) and argv[i + 1] in OLD_COMPILE_VALUES else None)
        if value is None:
            out.append(token)
            i += 1
            continue
        new = OLD_COMPILE_VALUES.get(value)
        if new is None:
            raise UsageError(f"--compile {value!r}: --compile or --no-compile is allowed")
        note = " (the VAE alone is no longer offered: --compile compiles the whole step)" if value == "vae" else ""
        err.print(f"[yellow]warning:[/] --compile {value} is deprecated and goes in the next release: use "
                  f"{' '.join(new) or 'neither --compile nor --no-compile'}{note}", highlight=False)
        out += new
        i += 1 if "=" in token else 2
    return out


def avatars_dir(value: Optional[Path]) -> Optional[Path]:
    """--avatars, else $LIPSTREAM_AVATARS, else ./avatars."""
    if value is not None:
        return value
    env = os.environ.get("LIPSTREAM_AVATARS")
    return Path(env) if env else Path("avatars")


_IMPORTED = time.perf_counter()


# Set when a command's output is complete and nothing is left to release but the process itself (entry()
# then skips the interpreter's teardown).
finished = False


def mark_finished() -> None:
    global finished
    finished = True


def process_age() -> float:
    """Seconds since this process started (from /proc on Linux; elsewhere since this module was imported)."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks after boot
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


@contextlib.contextmanager
def start_without_collections() -> Iterator[None]:
    """A one-shot command's start (torch's import, the networks) makes a few hundred thousand objects that
    live as long as the process, and the garbage collector walked them ~450 times meanwhile, each time
    holding the GIL (161 ms of a tiny CPU render, three full collections 103 ms of it). Off while it starts;
    then what it made is frozen out of the render's collections (a start that fails freezes nothing). The
    caller unfreezes when its command is done (`main` may run again in this process: the tests)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        gc.freeze()
    finally:
        if enabled:
            gc.enable()


def warn_random_weights() -> None:
    from lipstream.models import RANDOM_WARNING

    err.print(Panel(RANDOM_WARNING, title="WARNING", style="bold red"))


def load_models(models, device: str, random_weights: bool, random_size: str, avatar_meta: dict | None = None,
                **kwargs):
    """The networks for a command: the warning first when they are random, then loaded on the chosen device."""
    from lipstream.models import load_musetalk
    from lipstream.engine.networks import pick_device

    device = pick_device(device)
    size = random_size_for(random_size, device.type, avatar_meta)
    if random_weights:
        warn_random_weights()
        err.print(f"random networks: {size} size on {device}", highlight=False)
    return load_musetalk(models, device=device, random_weights=random_weights, size=size, warn=False, **kwargs)


def report_line(report, note: str = "") -> str:
    """A finished render's line: frames, rate, time, speed against real time, the first frame."""
    return (f"wrote {report.output}: {report.frames} frames at {report.fps} fps ({report.duration_s:.2f} s of audio) "
            f"in {report.wall_s:.2f} s = [bold]{report.render_fps:.1f} fps[/] "
            f"({report.render_fps / float(report.fps):.1f}x real time), first frame after {report.first_frame_s:.2f} s"
            + (f" [{note}]" if note else ""))
