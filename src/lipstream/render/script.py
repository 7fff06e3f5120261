"""Broadcast scripts: scenes (avatar, audio or text, start frame, transition), camera cuts and the newsroom
show around them (titles, picture-in-picture, cutaways, logo, ticker, music: show/schema.py), from YAML.

    fps: 25                      # optional; default: the first scene's avatar
    avatars: ./avatars           # optional; folder holding compiled avatars (relative to the script)
    scenes:
      - avatar: anchor           # one camera for the whole scene
        audio: intro.wav
        start_frame: 40          # where in its loop the avatar starts (default 0)
      - audio: story.mp3
        transition: {crossfade: 12}   # or "cut" (default)
        cameras:                 # a studio cutting between cameras while the audio runs on
          - {at: 0.0, avatar: wide}
          - {at: 3.5, avatar: closeup}
      - avatar: anchor
        text: "Markets closed higher today."   # spoken by the TTS instead of an audio file
        lower_third: {title: "Anna Berg", subtitle: "Berlin", from: 0.5, to: 5.0}
    overlays: {logo: {image: logo.png, corner: top-right}, ticker: {text: "Breaking: ...", speed: 120}}
    music: {file: bed.mp3, gain_db: -18, duck_db: -12}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from lipstream.errors import InputError
from lipstream.files import check_file
from lipstream.show.schema import (SCENE_SHOW_KEYS, TOP_SHOW_KEYS, check_keys, file_name, parse_scene_layers,
                                   parse_show, short)
from lipstream.yaml_input import load_yaml_file
from lipstream.show.spec import Show

SCENE_KEYS = ("avatar", "audio", "text", "cameras", "start_frame", "transition", "model", *SCENE_SHOW_KEYS)
MODELS = ("musetalk", "keysync")  # which lip-sync model renders a scene
TOP_KEYS = ("fps", "avatars", "scenes", *TOP_SHOW_KEYS)
MAX_SCENES = 500  # a long show has tens; each scene opens its audio and plans its cameras


@dataclass(frozen=True)
class Shot:
    at: float  # seconds from the start of the scene
    avatar: str


@dataclass
class Scene:
    audio: Path | None  # None: a text scene, its speech made by the TTS (show/tts.py) before the render
    shots: list[Shot]
    start_frame: int = 0
    crossfade: int = 0  # frames of dissolve from the previous scene; 0 = cut
    text: str | None = None  # what the TTS speaks instead of `audio`: exactly one of the two is set
    model: str | None = None  # "musetalk" or "keysync"; None: the render's (--model)


@dataclass
class Program:
    scenes: list[Scene]
    fps: Fraction | None = None
    avatars_dir: Path | None = None
    source: Path | None = field(default=None, repr=False)
    show: Show = field(default_factory=Show)  # the layers around the presenters; show.scenes[k] is scene k's


def scene_models(program: Program, default: str) -> list[str]:
    """The model each scene renders with: its own `model:`, else `default` (the render's --model)."""
    return [scene.model or default for scene in program.scenes]


def single_scene(avatar: str, audio: Path, start_frame: int = 0) -> Program:
    return Program([Scene(Path(audio), [Shot(0.0, avatar)], start_frame)])


def load_script(path: str | Path) -> Program:
    """The script in `path`, read within yaml_input's bounds (size, aliases, duplicate keys): every mistake
    one line naming the file."""
    path = check_file(path, "broadcast script")
    data = load_yaml_file(path)
    if not isinstance(data, dict) or not isinstance(data.get("scenes"), list) or not data["scenes"]:
        raise InputError(path, "needs a non-empty 'scenes:' list")
    check_keys(path, "", data, TOP_KEYS)
    if len(data["scenes"]) > MAX_SCENES:
        raise InputError(path, f"{len(data['scenes'])} scenes; a script of at most {MAX_SCENES} is allowed")
    base = path.parent
    scenes = [_scene(path, base, i, s) for i, s in enumerate(data["scenes"])]
    show = parse_show(path, base, data, [parse_scene_layers(path, base, f"scene {i + 1}", s)
                                         for i, s in enumerate(data["scenes"])])
    if scenes[0].crossfade:
        raise InputError(path, "scene 1 cannot cross-fade: there is nothing before it")
    fps = data.get("fps")
    try:
        fps = Fraction(str(fps)) if fps is not None else None
    except (ValueError, ZeroDivisionError):
        raise InputError(path, f"fps: {short(fps)} is not a frame rate") from None
    if fps is not None and fps <= 0:
        raise InputError(path, "fps must be positive")
    avatars = data.get("avatars")
    avatars = file_name(path, "", "avatars", avatars) if avatars is not None else None
    return Program(scenes, fps, (base / avatars) if avatars else None, path, show)


def _scene(path: Path, base: Path, i: int, s: object) -> Scene:
    where = f"scene {i + 1}"
    if not isinstance(s, dict):
        raise InputError(path, f"{where}: expected a mapping with 'audio' (or 'text') and 'avatar' or 'cameras'")
    check_keys(path, f"{where}: ", s, SCENE_KEYS)
    if "audio" not in s and "text" not in s:
        raise InputError(path, f"{where}: missing 'audio' (or 'text': words for the TTS to speak)")
    if "audio" in s and "text" in s:
        raise InputError(path, f"{where}: give either 'audio' or 'text', not both")
    audio = text = None
    if "audio" in s:
        audio = file_name(path, f"{where}: ", "audio", s["audio"])
        audio = audio if audio.is_absolute() else base / audio
    else:
        text = s["text"]
        if isinstance(text, (int, float)) and not isinstance(text, bool):
            text = str(text)
        if not isinstance(text, str) or not text.strip():
            raise InputError(path, f"{where}: text must be the words to speak, got {short(s['text'])}")
        text = text.strip()
    if ("avatar" in s) == ("cameras" in s):
        raise InputError(path, f"{where}: give either 'avatar' or 'cameras', not both or neither")
    if "avatar" in s:
        shots = [Shot(0.0, avatar_name(path, f"{where}: ", s["avatar"]))]
    else:
        cams = s["cameras"]
        if not isinstance(cams, list) or not cams or not all(isinstance(c, dict) and {"at", "avatar"} <= set(c)
                                                               for c in cams):
            raise InputError(path, f"{where}: 'cameras' must be a list of {{at: seconds, avatar: name}}")
        try:
            shots = sorted((Shot(float(c["at"]), avatar_name(path, f"{where}: camera: ", c["avatar"]))
                            for c in cams), key=lambda c: c.at)
        except (TypeError, ValueError):
            raise InputError(path, f"{where}: camera 'at' must be a number of seconds") from None
        if shots[0].at != 0:
            raise InputError(path, f"{where}: the first camera must start at 0")
    start = s.get("start_frame", 0)
    if not isinstance(start, int) or start < 0:
        raise InputError(path, f"{where}: start_frame must be a whole number >= 0")
    crossfade = _transition(path, where, s.get("transition", "cut"))
    model = s.get("model")
    if model is not None and model not in MODELS:
        raise InputError(path, f"{where}: model must be one of {', '.join(MODELS)}, got {short(model)}")
    return Scene(audio, shots, start, crossfade, text, model)


def avatar_name(path: Path, where: str, value: object) -> str:
    """An avatar's name (or folder) as the script gives it: text (a number is taken as text), short enough
    to be a file name, so nothing else reaches the filesystem."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    return str(file_name(path, where, "avatar", value))


def _transition(path: Path, where: str, t: object) -> int:
    if t in (None, "cut"):
        return 0
    if isinstance(t, dict) and set(t) == {"crossfade"} and isinstance(t["crossfade"], int) and t["crossfade"] > 0:
        return t["crossfade"]
    raise InputError(path, f"{where}: transition must be 'cut' or {{crossfade: FRAMES}}, got {short(t)}")
