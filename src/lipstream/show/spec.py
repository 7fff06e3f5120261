"""What a broadcast script asks of the show, as plain data (schema.py makes it; compose.py, mix.py and
tts.py read it). Times are seconds from the start of the scene they belong to; `end` None means the end
of that scene (of the show, for the whole-show overlays)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

CORNERS = ("top-left", "top-right", "bottom-left", "bottom-right")
DEFAULT_FADE_S = 0.24  # fade in and out over a few frames (6 at 25 fps)


@dataclass(frozen=True)
class Span:
    start: float = 0.0  # `from:`
    end: float | None = None  # `to:`; None = the end of the scene
    fade: float = DEFAULT_FADE_S  # seconds of fade in after `start` and out before `end`


@dataclass(frozen=True)
class LowerThird:
    """A name strap: title over subtitle on a band, bottom left, above the ticker's band if there is one."""

    title: str
    subtitle: str = ""
    span: Span = Span()


@dataclass(frozen=True)
class Picture:
    """A still or a video shown over the presenter. pip: in `box`; cutaway: `box` None, the whole frame.

    The source keeps its aspect ratio: it is scaled to fit inside the box and centred there. A video
    shows its frame at (scene time - span.start) seconds; past its end it loops (`loop: true`) or holds
    its last frame (the default)."""

    source: Path
    box: tuple[int, int, int, int] | None = None  # x1, y1, x2, y2 in output pixels (x2, y2 exclusive)
    span: Span = Span()
    loop: bool = False


@dataclass(frozen=True)
class Logo:
    image: Path  # PNG (alpha kept) or any still
    corner: str = "top-right"  # one of CORNERS
    margin: int = 32  # pixels from both edges of that corner
    height: int | None = None  # scaled to this many pixels high (aspect kept); None = its own size


@dataclass(frozen=True)
class Ticker:
    """A band at the bottom of the frame, the text scrolling right to left at `speed` pixels per second
    and starting again when it has passed."""

    text: str
    speed: float = 120.0


@dataclass(frozen=True)
class Music:
    file: Path
    gain_db: float = -18.0  # the bed's level in the gaps, relative to its file
    duck_db: float = -12.0  # further, under speech
    loop: bool = True  # a bed shorter than the show starts again


@dataclass
class SceneLayers:
    lower_third: LowerThird | None = None
    pip: Picture | None = None
    cutaway: Picture | None = None

    def any(self) -> bool:
        return any((self.lower_third, self.pip, self.cutaway))


@dataclass
class Show:
    """Everything around the presenters. `scenes[k]` belongs to the program's scene k."""

    scenes: list[SceneLayers] = field(default_factory=list)
    logo: Logo | None = None
    ticker: Ticker | None = None
    music: Music | None = None
    font: Path | None = None  # a TrueType/OpenType file for every text; None = Pillow's scalable default
    voice: str | None = None  # text scenes: an espeak-ng voice name or a Piper .onnx file; None = espeak-ng "en"

    def visual(self) -> bool:
        """Whether any layer paints pixels (when none does, the render pays nothing)."""
        return bool(self.logo or self.ticker or any(s.any() for s in self.scenes))

    def files(self) -> list[Path]:
        """Every file the show reads (a server job uploads these)."""
        out = [p.source for s in self.scenes for p in (s.pip, s.cutaway) if p is not None]
        out += [x for x in (self.logo and self.logo.image, self.music and self.music.file, self.font) if x]
        if self.voice and self.voice.endswith(".onnx"):
            out.append(Path(self.voice))
        return out
