"""What a job sends to a running `lipstream serve` (`lipstream render --server URL`), checked before it goes.

The checks a local render makes before torch (the output path, each audio file), plus a header probe of each
audio file, since the upload is what costs; for a broadcast, the script rewritten for the server (each file
under the name it is uploaded as, the server's avatars) and the show's files; then, against the server's
avatar listing, every avatar named and the show's boxes on the server's frame size. jobs.py talks to
the server. No torch: PyAV (the header probe) and YAML.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from lipstream.errors import InputError
from lipstream.files import check_file
from lipstream.render.checks import AUDIO_SUFFIXES, SHOW_SUFFIXES, check_program_inputs, file_suffix, show_suffix
from lipstream.render.script import Program


@dataclass(frozen=True)
class Upload:
    """A job's inputs as the server takes them. A render: `avatar` and one audio file. A broadcast: the
    script rewritten for the server (each audio under the name it is uploaded as, the server's avatars),
    and those files. `avatars`: every avatar the program names, in order; `notes`: what the rewrite left
    out, for the user to see."""

    kind: str
    avatars: tuple[str, ...]
    audio: dict[str, Path]  # upload name -> local file
    avatar: str | None = None
    script: str | None = None
    source: Path | None = None
    notes: tuple[str, ...] = ()
    files: dict[str, Path] = field(default_factory=dict)  # a broadcast's show files: upload name -> local file
    program: Program | None = field(default=None, repr=False)  # the show is checked against the server's frame

    @property
    def bytes(self) -> int:
        return (sum(p.stat().st_size for p in [*self.audio.values(), *self.files.values()])
                + len(self.script or ""))


def probe_audio(path: Path) -> Path:
    """An audio file the server can take, checked before it is uploaded: present and readable (preflight's
    check, the local render's wording), a suffix the server accepts, and a header PyAV reads with an audio
    stream in it. The samples themselves are decoded on the server (a damaged file fails the job there)."""
    from lipstream.media.demux import open_input

    path = check_file(path, "audio file")
    if path.suffix.lower() not in AUDIO_SUFFIXES:
        raise InputError(path, "with --server the audio must be a file ending in one of "
                               f"{', '.join(sorted(AUDIO_SUFFIXES))}")
    if path.stat().st_size == 0:
        raise InputError(path, "is empty (0 bytes)")
    import av

    try:
        with open_input(path) as container:
            if not any(s.type == "audio" for s in container.streams):
                raise InputError(path, "has no audio stream")
    except av.FFmpegError as e:
        why = getattr(e, "strerror", None) or str(e) or type(e).__name__
        raise InputError(path, f"not a readable audio or video file ({why})") from None
    return path


def prepare_upload(program: Program, kind: str, output: Path) -> Upload:
    """The checks a local render makes before torch (the output path, every audio file) and the header
    probe, then the job's inputs: one file per distinct audio, named for the upload, and (a broadcast)
    one per distinct file of its show, each present and of a kind the server takes (the rest of the show's
    checks need the server's frame size: run_job makes them before the upload)."""
    check_program_inputs(program, output)
    names: dict[Path, str] = {}
    for scene in program.scenes:
        if scene.audio is None:
            continue
        key = scene.audio.resolve()
        if key not in names:
            probe_audio(scene.audio)
            names[key] = upload_name(len(names) + 1, scene.audio, "audio")
    audio = {names[scene.audio.resolve()]: scene.audio for scene in program.scenes if scene.audio is not None}
    avatars = tuple(dict.fromkeys(shot.avatar for scene in program.scenes for shot in scene.shots))
    if kind == "render":
        return Upload(kind, avatars, audio, avatar=avatars[0], source=program.source)
    notes = ()
    if program.avatars_dir is not None:
        notes = (f"{program.source}: its 'avatars: {program.avatars_dir}' is not used with --server: the avatars "
                 "are the server's",)
    shown = show_uploads(program)
    for name, path in shown.items():
        names.setdefault(path.resolve(), name)  # a file that is a scene's audio too keeps its audio name
    return Upload(kind, avatars, audio, script=server_script(program, names), source=program.source, notes=notes,
                  files=shown, program=program)


def upload_name(n: int, path: Path, fallback: str, prefix: str = "") -> str:
    """`01-intro_speech.wav`: numbered (two files of one name stay two), the stem made safe, the suffix kept."""

    suffix = file_suffix(path.name)
    stem = path.name[:len(path.name) - len(suffix)] if suffix else path.name
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", stem)[:40] or fallback
    return f"{prefix}{n:02d}-{stem}{suffix}"


def show_uploads(program: Program) -> dict[str, Path]:
    """Upload name -> local file for every file the show reads (Show.files(): each once; a Piper voice
    with its .onnx.json beside it), each present and ending as the server takes show files."""

    out: dict[str, Path] = {}
    seen: set[Path] = set()
    wanted = list(program.show.files())
    if program.show.voice and program.show.voice.lower().endswith(".onnx"):
        config = Path(program.show.voice + ".json")
        if config.is_file():
            wanted.append(config)
    for path in wanted:
        if path.resolve() in seen:
            continue
        seen.add(path.resolve())
        check_file(path, "file of the show")
        if show_suffix(path.name) is None:
            raise InputError(path, "with --server a show's file must end in one of "
                                   f"{', '.join(sorted(SHOW_SUFFIXES))}")
        if path.name.lower().endswith(".onnx.json"):  # beside its voice, as Piper looks for it
            voice = next(n for n, p in out.items() if Path(str(p) + ".json").resolve() == path.resolve())
            out[voice + ".json"] = path
        else:
            out[upload_name(len(out) + 1, path, "file", "show")] = path
    return out


def server_script(program: Program, names: dict[Path, str]) -> str:
    """The broadcast script as the server takes it: the same scenes and show, each file by its upload name
    (`names`: resolved local path -> upload name), no avatars folder (the server's own)."""
    import yaml

    from lipstream.show.schema import layers_doc, show_doc

    def name(path: Path) -> str:
        return names[Path(path).resolve()]

    layers = program.show.scenes
    scenes = []
    for k, scene in enumerate(program.scenes):
        entry: dict = {"audio": name(scene.audio)} if scene.audio is not None else {"text": scene.text}
        if len(scene.shots) == 1 and scene.shots[0].at == 0:
            entry["avatar"] = scene.shots[0].avatar
        else:
            entry["cameras"] = [{"at": shot.at, "avatar": shot.avatar} for shot in scene.shots]
        if scene.start_frame:
            entry["start_frame"] = scene.start_frame
        if scene.crossfade:
            entry["transition"] = {"crossfade": scene.crossfade}
        if k < len(layers):
            entry.update(layers_doc(layers[k], name))
        scenes.append(entry)
    doc = ({"fps": str(program.fps)} if program.fps is not None else {}) | {"scenes": scenes}
    return yaml.safe_dump(doc | show_doc(program.show, name), sort_keys=False, allow_unicode=True)


def check_avatars(upload: Upload, listing: list[dict], url: str) -> None:
    """Every avatar the job names is resident on the server (else: the ones it has), one frame size."""
    have = {a["name"]: a for a in listing}
    for name in upload.avatars:
        if name not in have:
            named = " (with --server an avatar is named, not a folder)" if "/" in name or "\\" in name else ""
            listed = f"it has: {', '.join(sorted(have))}" if have else "it has no avatars"
            raise InputError(name, f"unknown avatar: not on the server at {url} ({listed}){named}")
    sizes = {(have[n]["width"], have[n]["height"]) for n in upload.avatars}
    if len(sizes) > 1:
        listed = ", ".join(f"{n} {have[n]['width']}x{have[n]['height']}" for n in upload.avatars)
        raise InputError(upload.source or upload.avatars[0],
                         f"all avatars of one video must have the same frame size ({listed})")
    if upload.program is not None:  # the show against the server's frame size, before anything is uploaded
        from lipstream.show.checks import check_show, declared_durations, frame_size_of

        program = upload.program
        check_show(program, frame_size_of([have[n] for n in upload.avatars]),
                   declared_durations(program) if program.show.visual() else None)
