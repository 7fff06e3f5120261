"""A render's inputs checked before anything heavy loads: the output path, the audio files, the avatars.

A local render and `render --server` run the same checks on what the user gave (check_program_inputs);
a local one also resolves every avatar and holds the program to one frame size (check_program).
No torch: every mistake is one line in a fraction of a second.
"""

from __future__ import annotations

from pathlib import Path

from lipstream.avatar.folders import avatar_meta, resolve_avatar
from lipstream.errors import InputError
from lipstream.files import check_file, check_output_path


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
