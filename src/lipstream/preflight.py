"""Checks that run before anything heavy is imported or loaded: options, paths, avatars, models.

Building the full-size networks takes 6-20 s, and importing torch several more; a
wrong avatar name or a typo in an option must not wait for that. Nothing here imports torch, so
every mistake below is reported in a fraction of a second, as one line.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

from lipstream.errors import InputError, LipStreamError, check_file
from lipstream.options import DECODE_ROWS, ENGINE_PRESETS, MAX_BATCH, X264_PRESETS, EngineOptions, RenderOptions
from lipstream.rates import as_fps

RANDOM_SIZES = ("auto", "full", "tiny")
MAX_FPS = 240
MAX_ENCODERS = 64
AVATAR_META = "avatar.json"


class UsageError(LipStreamError):
    """A command-line option with a value that is not allowed (exit status 2, like click's own)."""

    exit_code = 2


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


def machine_options(device: str, random_size: str) -> None:
    """--device and --random-size, checked."""
    device_option(device)
    one_of("--random-size", random_size, RANDOM_SIZES)


def random_size_for(choice: str, device: str, avatar_meta: dict | None = None) -> str:
    """'auto' -> the size the avatar's random VAE had, else tiny on a CPU (a full-size frame takes seconds
    there) and full on a GPU; 'tiny' and 'full' as asked."""
    if choice != "auto":
        return choice
    made_with = ((avatar_meta or {}).get("vae") or {}).get("random")
    if made_with in ("tiny", "full"):
        return made_with
    return "tiny" if device == "cpu" else "full"


def avatar_names(avatars_dir: Path | None) -> list[str]:
    """The compiled avatars in a folder (sub-folders holding avatar.json), sorted."""
    if avatars_dir is None or not Path(avatars_dir).is_dir():
        return []
    return sorted(p.name for p in Path(avatars_dir).iterdir() if (p / AVATAR_META).is_file())


def resolve_avatar(name: str, avatars_dir: Path | None) -> Path:
    """A compiled avatar by folder path, or by name inside the avatars folder."""
    candidates = [Path(name)] + ([Path(avatars_dir) / name] if avatars_dir is not None else [])
    for folder in candidates:
        if (folder / AVATAR_META).is_file():
            return folder
    for folder in candidates:
        if folder.is_dir():
            raise InputError(folder, f"is a folder but not a compiled avatar (no {AVATAR_META}); make one with "
                                     "`lipstream compile VIDEO -o AVATARS_DIR`")
    if avatars_dir is None or not Path(avatars_dir).is_dir():
        where = f"the avatars folder {avatars_dir} does not exist" if avatars_dir else "no avatars folder given"
        raise InputError(name, f"unknown avatar: {where} (pass --avatars DIR, or make one with "
                               "`lipstream compile VIDEO -o DIR`)")
    names = avatar_names(avatars_dir)
    have = f"it holds: {', '.join(names)}" if names else "it holds no compiled avatars"
    raise InputError(name, f"unknown avatar: not in {avatars_dir} ({have})")


def avatar_meta(folder: Path) -> dict:
    """An avatar's avatar.json, checked enough to plan a render (the loader checks the rest)."""
    path = Path(folder) / AVATAR_META
    try:
        meta = json.loads(path.read_text())
        int(meta["width"]), int(meta["height"]), Fraction(meta["fps"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(path, f"is not a readable avatar description ({type(e).__name__}: {e}); "
                               "compile the avatar again") from None
    return meta


def check_output_path(dest: str | Path) -> Path:
    """Fail early, before any work, if `dest` cannot become an output file."""
    dest = Path(dest)
    if dest.is_dir():
        raise InputError(dest, "is a folder, expected an output file name")
    parent = dest.parent if str(dest.parent) else Path(".")
    if not parent.is_dir():
        raise InputError(dest, f"output folder {parent} does not exist")
    return dest


def check_program_inputs(program, output: Path) -> None:
    """The output path, then every scene's audio file present and readable: what a render checks of its
    files wherever it runs (here, or on a server: `--server`). A text scene has no file: the TTS speaks it."""
    check_output_path(output)
    for scene in program.scenes:
        if scene.audio is not None:
            check_file(scene.audio, "audio file")


def check_program(program, avatars_dir: Path | None, output: Path) -> dict[str, dict]:
    """Every avatar of a program resolved (name -> avatar.json), its audio files present, one frame size.

    `program` is a script.Program; returns the avatars' metadata in the order they appear.
    """
    check_program_inputs(program, output)
    avatars_dir = program.avatars_dir or avatars_dir
    metas: dict[str, dict] = {}
    for scene in program.scenes:
        for shot in scene.shots:
            if shot.avatar not in metas:
                folder = resolve_avatar(shot.avatar, avatars_dir)
                metas[shot.avatar] = {**avatar_meta(folder), "_folder": str(folder)}
    sizes = {(m["width"], m["height"]) for m in metas.values()}
    if len(sizes) > 1:
        listed = ", ".join(f"{name} {m['width']}x{m['height']}" for name, m in metas.items())
        raise InputError(program.source or program.scenes[0].audio or "script",
                         f"all avatars of one video must have the same frame size ({listed})")
    return metas


def check_models(models: Path | None, random_weights: bool) -> None:
    """The models folder exists (unless the networks are random)."""
    if random_weights:
        return
    from lipstream.models.layout import HOW_TO_GET, models_dir

    root = models_dir(models)
    if not root.is_dir():
        raise LipStreamError(f"models folder {root} does not exist; {HOW_TO_GET}; or try LipStream without "
                             "them: --random-weights (untrained networks, the mouth is noise)")
