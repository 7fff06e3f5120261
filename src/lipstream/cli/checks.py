"""The command line's options checked before anything heavy is imported or loaded.

Building the full-size networks takes 6-20 s, and importing torch several more; a typo in an option
must not wait for that. Nothing here imports torch, so every mistake is reported in a fraction of a
second, as one line (UsageError: exit status 2).
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

from lipstream.engine.options import DECODE_ROWS, ENGINE_PRESETS, MAX_BATCH, EngineOptions
from lipstream.errors import LipStreamError, UsageError
from lipstream.media.rates import as_fps
from lipstream.render.options import MAX_ENCODERS, MAX_FPS, X264_PRESETS, RenderOptions

RANDOM_SIZES = ("auto", "full", "tiny")


def fps_option(value: str | None, option: str = "--fps") -> Fraction | None:
    """A frame rate given on the command line, exact (29.97 is 30000/1001); None stays None."""
    if value is None:
        return None
    try:
        fps = as_fps(value.strip())
    except ValueError:
        fps = None
    if fps is None or fps > MAX_FPS:
        raise UsageError(f"{option} {value!r}: expected a frame rate above 0 and at most {MAX_FPS}, "
                         "such as 25, 29.97 or 30000/1001")
    return fps


def in_range(option: str, value: int | float, low: int | float, high: int | float, what: str = "") -> None:
    if not low <= value <= high:
        raise UsageError(f"{option} {value}: expected {what or 'a value'} from {low} to {high}")


def one_of(option: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"{option} {value!r}: expected one of {', '.join(choices)}")


def device_option(value: str) -> None:
    """auto, cpu, cuda or cuda:N (whether CUDA is there is checked when torch is loaded)."""
    if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
        return
    raise UsageError(f"--device {value!r}: expected auto, cpu, cuda or cuda:N")


def render_options(fps: str | None, crf: int, x264_preset: str | None, batch: int | None, encoders: int | None,
                   decode_rows: str, reference: bool = False, encoder_processes: bool | None = None) -> RenderOptions:
    """The render and broadcast flags a user typed, each checked (one line naming the flag), as the options
    render_program takes; what is left open (None) is chosen for the machine when it renders."""
    in_range("--crf", crf, 0, 51, "an x264 quality")
    if x264_preset is not None:
        one_of("--x264-preset", x264_preset, X264_PRESETS)
    if batch is not None:
        in_range("--batch", batch, 1, MAX_BATCH, "frames per batch")
    if encoders is not None:
        in_range("--encoders", encoders, 1, MAX_ENCODERS, "a number of encoders")
    one_of("--decode-rows", decode_rows, DECODE_ROWS)
    # the reference path: the plain eager fp32 maths, whatever the flags for the fast one say
    engine = ENGINE_PRESETS["reference"].replace(batch=batch) if reference else \
        EngineOptions(batch=batch, decode_rows=decode_rows)
    return RenderOptions(engine, fps=fps_option(fps), crf=crf, x264_preset=x264_preset, encoders=encoders,
                         encoder_processes=encoder_processes)


def model_options(model: str, keysync_preset: str, *, server: str | None, reference: bool, batch: int | None,
                  compile: bool | None, decode_rows: str) -> None:
    """--model and the flags that apply to one model only, checked."""
    from lipstream.keysync.options import KEYSYNC_PRESETS

    one_of("--model", model, ("musetalk", "keysync"))
    one_of("--keysync-preset", keysync_preset, tuple(KEYSYNC_PRESETS))
    if model != "keysync":
        return
    for flag, given in (("--reference", reference), ("--batch", batch is not None),
                        ("--compile/--no-compile", compile is not None), ("--decode-rows", decode_rows != "auto")):
        if given:
            raise UsageError(f"{flag} applies to --model musetalk; KeySync takes --keysync-preset")
    if server and keysync_preset != "reference":
        raise UsageError("--keysync-preset: a server renders KeySync with its own preset (reference)")


def machine_options(device: str, random_size: str) -> None:
    """--device and --random-size, checked."""
    device_option(device)
    one_of("--random-size", random_size, RANDOM_SIZES)


def check_models(models: Path | None, random_weights: bool) -> None:
    """The models folder exists (unless the networks are random)."""
    if random_weights:
        return
    from lipstream.models.layout import HOW_TO_GET, models_dir

    root = models_dir(models)
    if not root.is_dir():
        raise LipStreamError(f"models folder {root} does not exist; {HOW_TO_GET}; or try LipStream without "
                             "them: --random-weights (untrained networks, the mouth is noise)")
