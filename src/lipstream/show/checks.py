"""The show's checks that need more than the script: the avatars' frame size (boxes, the logo, titles
that must fit), the scenes' lengths (times), and the files (present, and a header Pillow or PyAV reads).

They run before any network loads (cli/render.py's _render, the `--server` client once it knows the
server's frame size, and the server's broadcast route), so each mistake costs a fraction of a second and
is one line. No torch: Pillow and PyAV headers only, nothing decoded.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

from lipstream.errors import InputError
from lipstream.files import check_file
from lipstream.show.spec import Picture, Show, Span

# stills by suffix (anything else a pip or cutaway names is opened as a video); the server's list is this one
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
# the sizes a lower third's text is set at, as fractions of the frame's height, and the margin it keeps
# from the frame's left and right edges as a fraction of its width (show/text.py draws at these sizes)
TITLE_HEIGHT = 0.055
SUBTITLE_HEIGHT = 0.037
SIDE_MARGIN = 0.05
TIME_TOLERANCE_S = 0.01  # a `to:` this close past a scene's declared length is its end


def check_show(program, frame_size: tuple[int, int], scene_durations: Sequence[float | None] | None) -> None:
    """Raise InputError (one line, naming the script) for the first thing the show cannot do.

    `program` is a script.Program; `frame_size` (width, height) the avatars'; `scene_durations` each scene's
    seconds (None for the whole list, or for a text scene, whose length is known only after the TTS: its
    times are then only checked from < to, which the script's own parse did)."""
    show: Show = program.show
    where = program.source or "script"
    width, height = frame_size
    if show.font is not None:  # first: the titles are measured in it
        _font(show.font)
    for k, layers in enumerate(show.scenes):
        scene = f"scene {k + 1}"
        seconds = scene_durations[k] if scene_durations is not None and k < len(scene_durations) else None
        if layers.lower_third is not None:
            lt = layers.lower_third
            _times(where, f"{scene}: lower_third", lt.span, seconds)
            for key, text, share in (("title", lt.title, TITLE_HEIGHT), ("subtitle", lt.subtitle, SUBTITLE_HEIGHT)):
                _fits(where, f"{scene}: lower_third: {key}", text, share, frame_size, show.font)
        for key, pic in (("pip", layers.pip), ("cutaway", layers.cutaway)):
            if pic is not None:
                _picture(where, f"{scene}: {key}", pic, frame_size, seconds)
    if show.logo is not None:
        logo = show.logo
        w, h = _still_size(logo.image, "overlays: logo: image")
        if logo.height is not None:
            w, h = max(1, round(w * logo.height / h)), logo.height
        if w + logo.margin > width or h + logo.margin > height:
            raise InputError(where, f"overlays: logo: {w}x{h} at margin {logo.margin} does not fit in the "
                                    f"{width}x{height} frame (set a smaller height:)")
    if show.music is not None:
        _media(show.music.file, "music: file", "audio")
    if show.voice is not None and show.voice.lower().endswith(".onnx"):
        check_file(show.voice, "Piper voice file (voice:)")


def declared_durations(program) -> list[float | None]:
    """Each scene's length as its audio file's header declares it (no decode); None for a text scene or a
    header that does not say (the decode then finds the length, and reports a damaged file)."""
    return [None if scene.audio is None else declared_seconds(scene.audio) for scene in program.scenes]


def declared_seconds(path: Path) -> float | None:
    """Seconds of a file's first audio stream by its header; None when it cannot tell."""
    import av

    from lipstream.media.demux import open_input

    try:
        with open_input(path) as c:
            stream = next((s for s in c.streams if s.type == "audio"), None)
            if stream is None:
                return None
            if stream.duration is not None and stream.time_base:
                return float(stream.duration * stream.time_base)
            return c.duration / av.time_base if c.duration is not None else None
    except (av.FFmpegError, OSError):
        return None


def text_width(text: str, size: int, font: Path | None = None) -> float:
    """Pixels `text` spans at `size` pixels in `font` (None: Pillow's scalable default), as drawn."""
    return _font_at(None if font is None else str(font), size).getlength(text)


def frame_size_of(metas: Sequence[dict]) -> tuple[int, int]:
    """(width, height) from avatar.json's or /v1/avatars' rows (one size for all: checked before)."""
    first = next(iter(metas))
    return int(first["width"]), int(first["height"])


# -- the parts ---------------------------------------------------------------------------------------------

def _times(where, what: str, span: Span, seconds: float | None) -> None:
    if seconds is None:
        return
    if span.start >= seconds:
        raise InputError(where, f"{what}: from {span.start:g} s is past the scene's end ({seconds:.2f} s)")
    if span.end is not None and span.end > seconds + TIME_TOLERANCE_S:
        raise InputError(where, f"{what}: to {span.end:g} s is past the scene's end ({seconds:.2f} s)")


def _fits(where, what: str, text: str, share: float, frame_size: tuple[int, int], font: Path | None) -> None:
    if not text:
        return
    width, height = frame_size
    size = max(8, round(height * share))
    room = width - 2 * round(width * SIDE_MARGIN)
    wide = text_width(text, size, font)
    if wide > room:
        keep = max(1, int(len(text) * room / wide))
        raise InputError(where, f"{what} {_short(text)} does not fit: {wide:.0f} px wide at {size} px, the "
                                f"{width} px frame has {room} px (about {keep} characters)")


def _picture(where, what: str, pic: Picture, frame_size: tuple[int, int], seconds: float | None) -> None:
    width, height = frame_size
    if pic.box is not None:
        x1, y1, x2, y2 = pic.box
        if x2 > width or y2 > height:
            raise InputError(where, f"{what}: box {list(pic.box)} is outside the {width}x{height} frame")
    _times(where, what, pic.span, seconds)
    if pic.source.suffix.lower() in IMAGE_SUFFIXES:
        _still_size(pic.source, f"{what}: source")
    else:
        _media(pic.source, f"{what}: source", "video")


def _still_size(path: Path, what: str) -> tuple[int, int]:
    from PIL import Image, UnidentifiedImageError

    check_file(path, f"image ({what})")
    try:
        with Image.open(path) as im:
            w, h = im.size
    except UnidentifiedImageError:  # its message names the file, which on a server is the server's path
        raise InputError(path, f"not an image Pillow can read ({what}: not a known image format)") from None
    except (OSError, ValueError) as e:
        raise InputError(path, f"not an image Pillow can read ({what}: {_reason(e)})") from None
    if w <= 0 or h <= 0:
        raise InputError(path, f"is an empty image ({what})")
    return w, h


def _media(path: Path, what: str, kind: str) -> None:
    """A video (pip/cutaway) or an audio file (music) whose header PyAV reads, with a stream of that kind."""
    import av

    from lipstream.media.demux import open_input

    check_file(path, f"{kind} file ({what})")  # "no such video file (scene 1: pip: source)"
    if path.stat().st_size == 0:
        raise InputError(path, f"is empty (0 bytes) ({what})")
    try:
        with open_input(path) as c:
            streams = [s for s in c.streams if s.type == kind]
            if not streams:
                expected = "a video file or an image" if kind == "video" else "an audio file"
                raise InputError(path, f"has no {kind} stream ({what}: expected {expected})")
            if kind == "video" and not (streams[0].codec_context.width and streams[0].codec_context.height):
                raise InputError(path, f"has a video stream with no picture size ({what})")
    except av.FFmpegError as e:
        raise InputError(path, f"not a readable {kind} file ({what}: {_reason(e)})") from None


def _font(path: Path) -> None:
    check_file(path, "font file (font:)")
    try:
        _font_at(str(path), 20)
    except OSError:  # FreeType's reason ("unknown file format", "broken file") varies with its version
        raise InputError(path, "not a font Pillow can read (font: expected a TrueType or OpenType file)") from None


@lru_cache(maxsize=32)
def _font_at(font: str | None, size: int):
    from PIL import ImageFont

    return ImageFont.load_default(size=size) if font is None else ImageFont.truetype(font, size)


def _short(text: str, n: int = 40) -> str:
    return repr(text if len(text) <= n else text[:n - 1] + "…")


def _reason(e: BaseException) -> str:
    text = getattr(e, "strerror", None) or str(e) or type(e).__name__
    return " ".join(str(text).split())
