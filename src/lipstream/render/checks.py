"""A render's inputs checked before anything heavy loads: the output path, the audio files, the avatars, and
the kinds of file a job takes (by suffix: what a server accepts as uploads, what `--server` checks first).

A local render and `render --server` run the same checks on what the user gave (check_program_inputs);
a local one also resolves every avatar and holds the program to one frame size (check_program).
No torch: every mistake is one line in a fraction of a second.
"""

from __future__ import annotations

from pathlib import Path

from lipstream.avatar.folders import avatar_meta, resolve_avatar
from lipstream.errors import InputError
from lipstream.files import check_file, check_output_path
from lipstream.show.checks import IMAGE_SUFFIXES

# the files a job takes, by suffix: what a server accepts as uploads, and what a client checks before it sends them
VIDEO_SUFFIXES = frozenset({".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v"})
AUDIO_SUFFIXES = frozenset({".wav", ".mp3", ".m4a", ".aac", ".flac", ".ogg", ".opus", ".webm", ".mp4", ".mov", ".mkv"})
# a broadcast's show files (logo, pip and cutaway stills and videos, music, font, a Piper voice and its
# .onnx.json), uploaded beside its audio under names of this form
FONT_SUFFIXES = frozenset({".ttf", ".otf", ".ttc"})
SHOW_SUFFIXES = IMAGE_SUFFIXES | VIDEO_SUFFIXES | AUDIO_SUFFIXES | FONT_SUFFIXES | {".onnx", ".onnx.json"}


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


def file_suffix(name: str) -> str:
    """A file name's suffix, lower-case, taking a Piper voice's ".onnx.json" as one."""
    lower = name.lower()
    return ".onnx.json" if lower.endswith(".onnx.json") else Path(lower).suffix


def show_suffix(name: str) -> str | None:
    """The suffix by which a show file is taken, or None when it is not taken."""
    suffix = file_suffix(name)
    return suffix if suffix in SHOW_SUFFIXES else None
