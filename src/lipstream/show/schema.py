"""The broadcast script's show keys -> spec.Show, every mistake one line naming the scene and the key.

What can be checked from the script alone is checked here (unknown keys with the nearest valid name,
types, `from`/`to` order, empty boxes, corners, speeds); what needs the avatars' frame size, the
scenes' lengths or the files themselves is show/checks.py's. No torch, no Pillow: the script loads in
milliseconds. `layers_doc` and `show_doc` write a parsed show back as script keys (a server job's script
names its files as they were uploaded).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from lipstream.errors import InputError
from lipstream.show.spec import (
    CORNERS, DEFAULT_FADE_S, LowerThird, Logo, Music, Picture, SceneLayers, Show, Span, Ticker)

# the keys each mapping takes, in the order docs/render.md lists them (and the errors list them)
SCENE_SHOW_KEYS = ("lower_third", "pip", "cutaway")
TOP_SHOW_KEYS = ("overlays", "music", "font", "voice")
LOWER_THIRD_KEYS = ("title", "subtitle", "from", "to", "fade")
PIP_KEYS = ("source", "box", "from", "to", "loop", "fade")
CUTAWAY_KEYS = ("source", "from", "to", "loop", "fade")
OVERLAY_KEYS = ("logo", "ticker")
LOGO_KEYS = ("image", "corner", "margin", "height")
TICKER_KEYS = ("text", "speed")
MUSIC_KEYS = ("file", "gain_db", "duck_db", "loop")
MAX_NAME = 255  # characters in one part of a file name a script gives (the filesystems' own limit)
MAX_PATH = 4096
VOICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_+.-]{0,63}")  # espeak-ng: en, en-us, en+f3, mb-en1


def unknown_key(key: object, allowed: Iterable[str]) -> str:
    """"unknown key 'boxx' (did you mean 'box'?)", or the keys allowed when none is near."""
    allowed = list(allowed)
    near = difflib.get_close_matches(str(key), allowed, n=1)
    hint = f"did you mean {near[0]!r}?" if near else f"it takes: {', '.join(allowed)}"
    return f"unknown key {short(str(key))} ({hint})"


def check_keys(path: Path, where: str, mapping: Mapping, allowed: Iterable[str]) -> None:
    """The first key of `mapping` not in `allowed`, as one line: `where` (with its colon) before it."""
    allowed = list(allowed)
    for key in mapping:
        if key not in allowed:
            raise InputError(path, f"{where}{unknown_key(key, allowed)}")


def parse_scene_layers(path: Path, base: Path, where: str, scene: Mapping) -> SceneLayers:
    """A scene's lower_third, pip and cutaway (each optional); `where` is "scene N"."""
    layers = SceneLayers()
    if "lower_third" in scene:
        layers.lower_third = _lower_third(path, f"{where}: lower_third: ", scene["lower_third"])
    if "pip" in scene:
        layers.pip = _picture(path, base, f"{where}: pip: ", scene["pip"], PIP_KEYS)
    if "cutaway" in scene:
        layers.cutaway = _picture(path, base, f"{where}: cutaway: ", scene["cutaway"], CUTAWAY_KEYS)
    return layers


def parse_show(path: Path, base: Path, data: Mapping, scenes: list[SceneLayers]) -> Show:
    """The whole show: the scenes' layers (one per program scene) and the top-level overlays, music,
    font and voice of the script's mapping `data`."""
    show = Show(scenes=scenes)
    if data.get("overlays") is not None:
        overlays = _mapping(path, "overlays: ", data["overlays"], OVERLAY_KEYS)
        if "logo" in overlays:
            show.logo = _logo(path, base, "overlays: logo: ", overlays["logo"])
        if "ticker" in overlays:
            show.ticker = _ticker(path, "overlays: ticker: ", overlays["ticker"])
    if data.get("music") is not None:
        show.music = _music(path, base, "music: ", data["music"])
    if data.get("font") is not None:
        show.font = _path(path, base, "", "font", data["font"])
    if data.get("voice") is not None:
        show.voice = _voice(path, base, data["voice"])
    return show


# -- the parts ---------------------------------------------------------------------------------------------

def _lower_third(path: Path, where: str, value: object) -> LowerThird:
    m = _mapping(path, where, value, LOWER_THIRD_KEYS, required=("title",))
    title = _text(path, where, "title", m["title"])
    subtitle = _text(path, where, "subtitle", m["subtitle"], empty=True) if "subtitle" in m else ""
    return LowerThird(title, subtitle, _span(path, where, m))


def _picture(path: Path, base: Path, where: str, value: object, keys: tuple[str, ...]) -> Picture:
    m = _mapping(path, where, value, keys, required=("source", "box") if "box" in keys else ("source",))
    source = _path(path, base, where, "source", m["source"])
    box = _box(path, where, m["box"]) if "box" in keys else None
    return Picture(source, box, _span(path, where, m), _bool(path, where, "loop", m.get("loop", False)))


def _logo(path: Path, base: Path, where: str, value: object) -> Logo:
    m = _mapping(path, where, value, LOGO_KEYS, required=("image",))
    image = _path(path, base, where, "image", m["image"])
    corner = m.get("corner", "top-right")
    if corner not in CORNERS:
        near = difflib.get_close_matches(str(corner), CORNERS, n=1)
        hint = f"did you mean {near[0]!r}?" if near else f"one of {', '.join(CORNERS)}"
        raise InputError(path, f"{where}corner {short(corner)} is not a corner ({hint})")
    margin = _whole(path, where, "margin", m.get("margin", 32), low=0)
    height = _whole(path, where, "height", m["height"], low=1) if m.get("height") is not None else None
    return Logo(image, corner, margin, height)


def _ticker(path: Path, where: str, value: object) -> Ticker:
    m = _mapping(path, where, value, TICKER_KEYS, required=("text",))
    speed = _number(path, where, "speed", m.get("speed", 120.0), "pixels per second")
    if speed <= 0:
        raise InputError(path, f"{where}speed must be above 0 (pixels per second), got {speed:g}")
    return Ticker(_text(path, where, "text", m["text"]), speed)


def _music(path: Path, base: Path, where: str, value: object) -> Music:
    m = _mapping(path, where, value, MUSIC_KEYS, required=("file",))
    gain = _number(path, where, "gain_db", m.get("gain_db", -18.0), "dB")
    duck = _number(path, where, "duck_db", m.get("duck_db", -12.0), "dB")
    if duck > 0:
        raise InputError(path, f"{where}duck_db must be 0 or below (dB the music drops under speech), got {duck:g}")
    loop = _bool(path, where, "loop", m.get("loop", True))
    return Music(_path(path, base, where, "file", m["file"]), gain, duck, loop)


def _voice(path: Path, base: Path, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InputError(path, "voice must be an espeak-ng voice name (en, en-us) or a Piper .onnx file, "
                               f"got {short(value)}")
    value = value.strip()
    if value.lower().endswith(".onnx"):
        return str(_path(path, base, "", "voice", value))
    if not VOICE_NAME.fullmatch(value):
        raise InputError(path, f"voice {short(value)} is neither an espeak-ng voice name (en, en-us, de) nor a "
                               "Piper .onnx file")
    return value


def _span(path: Path, where: str, m: Mapping) -> Span:
    start = _number(path, where, "from", m.get("from", 0.0), "seconds")
    end = _number(path, where, "to", m["to"], "seconds") if m.get("to") is not None else None
    fade = _number(path, where, "fade", m.get("fade", DEFAULT_FADE_S), "seconds")
    if start < 0:
        raise InputError(path, f"{where}from {start:g} is negative: times are seconds from the scene's start")
    if end is not None and end <= start:
        raise InputError(path, f"{where}to ({end:g} s) must be after from ({start:g} s)")
    if fade < 0:
        raise InputError(path, f"{where}fade {fade:g} is negative: it is the seconds of fade in and out")
    return Span(float(start), None if end is None else float(end), float(fade))


def _box(path: Path, where: str, value: object) -> tuple[int, int, int, int]:
    if not (isinstance(value, list) and len(value) == 4 and all(_is_int(v) for v in value)):
        raise InputError(path, f"{where}box must be [x1, y1, x2, y2] in whole pixels, got {short(value)}")
    x1, y1, x2, y2 = value
    if min(value) < 0:
        raise InputError(path, f"{where}box {value} starts outside the frame (a negative coordinate)")
    if x2 <= x1 or y2 <= y1:
        raise InputError(path, f"{where}box {value} is empty: x2 must be above x1 and y2 above y1")
    return x1, y1, x2, y2


# -- the types --------------------------------------------------------------------------------------------

def _mapping(path: Path, where: str, value: object, keys: tuple[str, ...], required: tuple[str, ...] = ()) -> dict:
    if not isinstance(value, dict):
        raise InputError(path, f"{where.removesuffix(': ')} must be a mapping of {', '.join(keys)}, "
                               f"got {short(value)}")
    check_keys(path, where, value, keys)
    for key in required:
        if value.get(key) is None:
            raise InputError(path, f"{where}missing {key!r}")
    return value


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(path: Path, where: str, key: str, value: object, unit: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(path, f"{where}{key} must be a number ({unit}), got {short(value)}")
    return float(value)


def _whole(path: Path, where: str, key: str, value: object, low: int) -> int:
    if not _is_int(value) or value < low:
        raise InputError(path, f"{where}{key} must be a whole number of pixels >= {low}, got {short(value)}")
    return int(value)


def _bool(path: Path, where: str, key: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InputError(path, f"{where}{key} must be true or false, got {short(value)}")
    return value


def _text(path: Path, where: str, key: str, value: object, empty: bool = False) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # `title: 2024`
    if not isinstance(value, str):
        raise InputError(path, f"{where}{key} must be text, got {short(value)}")
    if "\n" in value.strip() or "\r" in value:
        raise InputError(path, f"{where}{key} must be one line of text")
    if not value.strip() and not empty:
        raise InputError(path, f"{where}{key} is empty")
    return value.strip()


def file_name(path: Path, where: str, key: str, value: object) -> Path:
    """A file or folder name as a script gives it: one line of text, each part of it at most MAX_NAME
    characters and the whole at most MAX_PATH, so a huge value is one line of error, not a system call."""
    if not isinstance(value, str) or not value.strip():
        raise InputError(path, f"{where}{key} must be a file name, got {short(value)}")
    value = value.strip()
    if len(value) > MAX_PATH or any(len(part) > MAX_NAME for part in re.split(r"[/\\\\]", value)) or "\0" in value:
        raise InputError(path, f"{where}{key}: a name of {len(value)} characters; a file name of at most "
                               f"{MAX_NAME} characters (a path of at most {MAX_PATH}) is allowed")
    if "\n" in value or "\r" in value:
        raise InputError(path, f"{where}{key} must be a file name on one line")
    return Path(value)


def short(value: object) -> str:
    """`value` for an error line: at most 80 characters of its repr (a script's value may be huge)."""
    text = repr(value) if not isinstance(value, (list, dict)) or len(value) < 20 else f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def _path(path: Path, base: Path, where: str, key: str, value: object) -> Path:
    p = file_name(path, where, key, value)
    return p if p.is_absolute() else base / p


# -- back to script keys -----------------------------------------------------------------------------------

def layers_doc(layers: SceneLayers, name: Callable[[Path], str] = str) -> dict:
    """A scene's layers as script keys (`name`: what each file is called in the script written)."""
    out: dict = {}
    if layers.lower_third is not None:
        lt = layers.lower_third
        out["lower_third"] = {"title": lt.title, **({"subtitle": lt.subtitle} if lt.subtitle else {}),
                              **_span_doc(lt.span)}
    for key, pic in (("pip", layers.pip), ("cutaway", layers.cutaway)):
        if pic is not None:
            out[key] = {"source": name(pic.source), **({"box": list(pic.box)} if pic.box else {}),
                        **_span_doc(pic.span), **({"loop": True} if pic.loop else {})}
    return out


def show_doc(show: Show, name: Callable[[Path], str] = str) -> dict:
    """The show's top-level keys (overlays, music, font, voice) as script keys."""
    out: dict = {}
    overlays: dict = {}
    if show.logo is not None:
        lg = show.logo
        overlays["logo"] = {"image": name(lg.image), "corner": lg.corner, "margin": lg.margin,
                            **({"height": lg.height} if lg.height is not None else {})}
    if show.ticker is not None:
        overlays["ticker"] = {"text": show.ticker.text, "speed": show.ticker.speed}
    if overlays:
        out["overlays"] = overlays
    if show.music is not None:
        mu = show.music
        out["music"] = {"file": name(mu.file), "gain_db": mu.gain_db, "duck_db": mu.duck_db, "loop": mu.loop}
    if show.font is not None:
        out["font"] = name(show.font)
    if show.voice is not None:
        out["voice"] = name(Path(show.voice)) if show.voice.lower().endswith(".onnx") else show.voice
    return out


def _span_doc(span: Span) -> dict:
    return {"from": span.start, **({"to": span.end} if span.end is not None else {}),
            **({"fade": span.fade} if span.fade != DEFAULT_FADE_S else {})}
