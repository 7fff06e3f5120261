"""Strings -> RGBA sprites (Pillow): the lower third's strap and the ticker's band and text strip.

Each string is rendered once, anti-aliased by FreeType, with Pillow's scalable default font or the
show's TrueType/OpenType file; compose.py converts the sprites to YUV once and only blends them per
frame. Sizes scale with the frame's height, so a show looks the same at 720p and 1080p. Every sprite
has even width and height (and compose.py puts them at even positions): I420's chroma is 2x2.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from lipstream.errors import InputError
from lipstream.files import check_file
from lipstream.show.spec import LowerThird

Font = ImageFont.FreeTypeFont

MAX_TITLE_FRACTION = 0.8  # a lower third's line may take this much of the frame's width
MAX_STRIP_PX = 60_000  # a ticker text longer than this is an error (a paste gone wrong, not a headline)
TICKER_BAND_FRACTION = 0.07  # the ticker's band: this much of the frame's height, at the bottom

STRAP_RGBA = (12, 26, 56, 215)  # the lower third's band: dark blue, mostly opaque
ACCENT_RGBA = (214, 38, 48, 255)  # its bar at the left edge
TITLE_RGB = (255, 255, 255)
SUBTITLE_RGB = (205, 214, 228)
BAND_RGBA = (10, 18, 36, 225)  # the ticker's band
TICKER_RGB = (255, 255, 255)


def even(n: float) -> int:
    """The nearest even integer >= 2 (I420 sprites have even sizes)."""
    return max(2, 2 * round(n / 2))


@lru_cache(maxsize=64)
def load_font(font: Path | None, size: int) -> Font:
    """A scalable font of `size` pixels: the show's file, or Pillow's own (Pillow >= 10.1)."""
    if font is None:
        out = ImageFont.load_default(size=size)
        if not isinstance(out, ImageFont.FreeTypeFont):  # Pillow built without FreeType: a 11 px bitmap
            raise InputError("pillow", "has no FreeType support; name a font file (font:) or reinstall Pillow")
        return out
    path = check_file(font, "font file")
    try:
        return ImageFont.truetype(str(path), size)
    except OSError:
        raise InputError(path, "not a TrueType/OpenType font Pillow can read") from None


def text_width(text: str, font: Font) -> int:
    """Pixels `text` takes on a line in `font`."""
    return int(np.ceil(font.getlength(text)))


def _line(text: str, font: Font, rgb: tuple[int, int, int], width: int | None = None) -> Image.Image:
    """`text` on a transparent RGBA line as tall as the font's ascent + descent (anti-aliased coverage as alpha)."""
    ascent, descent = font.getmetrics()
    w = width or text_width(text, font) + 2
    mask = Image.new("L", (w, ascent + descent), 0)
    ImageDraw.Draw(mask).text((1, 0), text, fill=255, font=font)
    out = Image.new("RGBA", mask.size, (*rgb, 0))
    out.putalpha(mask)
    return out


def _sizes(frame_h: int) -> dict[str, int]:
    """The lower third's measures in pixels for a frame `frame_h` high."""
    return {"title": max(8, round(frame_h * 0.046)), "subtitle": max(6, round(frame_h * 0.030)),
            "pad": even(frame_h * 0.018), "accent": even(frame_h * 0.008), "gap": even(frame_h * 0.006)}


def lower_third_sprite(lt: LowerThird, frame_w: int, frame_h: int, font: Path | None = None) -> np.ndarray:
    """The strap [h, w, 4] uint8 RGBA: a semi-opaque band with an accent bar, the title over the subtitle."""
    s = _sizes(frame_h)
    title_font = load_font(font, s["title"])
    sub_font = load_font(font, s["subtitle"])
    title = _line(lt.title, title_font, TITLE_RGB)
    sub = _line(lt.subtitle, sub_font, SUBTITLE_RGB) if lt.subtitle else None
    text_w = max(title.width, sub.width if sub else 0)
    text_h = title.height + (s["gap"] + sub.height if sub else 0)
    w = even(s["accent"] + 2 * s["pad"] + text_w + 1)
    h = even(2 * s["pad"] + text_h + 1)
    strap = Image.new("RGBA", (w, h), STRAP_RGBA)
    strap.paste(Image.new("RGBA", (s["accent"], h), ACCENT_RGBA), (0, 0))
    x = s["accent"] + s["pad"]
    strap.alpha_composite(title, (x, s["pad"]))
    if sub:
        strap.alpha_composite(sub, (x, s["pad"] + title.height + s["gap"]))
    return np.asarray(strap).copy()


def lower_third_problem(lt: LowerThird, frame_w: int, frame_h: int, font: Path | None = None) -> str | None:
    """Why `lt` does not fit a `frame_w` x `frame_h` frame (one line), or None when it does."""
    s = _sizes(frame_h)
    limit = int(MAX_TITLE_FRACTION * frame_w)
    if not lt.title.strip():
        return "lower third: the title is empty"
    for what, text, size in (("title", lt.title, s["title"]), ("subtitle", lt.subtitle, s["subtitle"])):
        if "\n" in text:
            return f"lower third: the {what} has a line break; one line each for title and subtitle"
        w = text_width(text, load_font(font, size))
        if w > limit:
            return (f"lower third: the {what} {_quote(text)} is {w} px wide, more than "
                    f"{MAX_TITLE_FRACTION:.0%} of the {frame_w} px frame ({limit} px); shorten it")
    return None


def ticker_band_height(frame_h: int) -> int:
    """Rows the ticker's band takes at the bottom of the frame."""
    return even(frame_h * TICKER_BAND_FRACTION)


def _ticker_font(frame_h: int, font: Path | None) -> Font:
    return load_font(font, max(6, round(ticker_band_height(frame_h) * 0.58)))


def ticker_strip(text: str, frame_w: int, frame_h: int, font: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(band [bh, frame_w, 4], text strip [bh, sw, 4]) RGBA uint8: the band, and the text rendered once,
    vertically centred on a transparent strip as tall as the band (compose.py scrolls it)."""
    bh = ticker_band_height(frame_h)
    f = _ticker_font(frame_h, font)
    line = _line(" ".join(text.split()), f, TICKER_RGB)
    strip = Image.new("RGBA", (even(line.width + 1), bh), (*TICKER_RGB, 0))
    strip.alpha_composite(line, (0, max(0, (bh - line.height) // 2)))
    band = Image.new("RGBA", (frame_w, bh), BAND_RGBA)
    return np.asarray(band).copy(), np.asarray(strip).copy()


def ticker_problem(text: str, frame_w: int, frame_h: int, font: Path | None = None) -> str | None:
    """Why the ticker's `text` cannot be shown (one line), or None when it can."""
    flat = " ".join(text.split())
    if not flat:
        return "ticker: the text is empty"
    w = text_width(flat, _ticker_font(frame_h, font))
    if w > MAX_STRIP_PX:
        return f"ticker: the text is {w} px long, more than {MAX_STRIP_PX} px; shorten it"
    return None


def _quote(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")
