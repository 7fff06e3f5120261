"""From a show's spec to its layers: sprites drawn and converted, pictures opened, every box and size checked.

`build_compositor` makes the Compositor (show/compose.py) a render paints with: each layer's sprite rendered,
converted to the frames' matrix and uploaded now, and every box, corner and text checked against the frame,
so a bad file or a layer that does not fit fails here, before any frame. `frame_times` and `scene_clock`
turn the render's scene bounds (its first frames) into the times the layers are planned by.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from lipstream.errors import InputError, LipStreamError
from lipstream.show import text as show_text
from lipstream.show.compose import (Compositor, FrameTime, Layer, Rect, SceneSpan, Sprite, SpriteLayer, TickerLayer,
                                    VideoLayer, _always)
from lipstream.show.sources import VideoSource, fit_box, load_still, probe_picture
from lipstream.show.spec import Logo, Picture, Show

LOWER_THIRD_MARGIN = 0.05  # of the frame's width (left) and height (above the ticker or the bottom)


def frame_times(bounds: Sequence[int], fps: float) -> list[FrameTime]:
    """Every output frame's (scene, scene time, show time) from the scenes' first frames `bounds`
    (render/program.py's: scene k is frames bounds[k]..bounds[k+1]-1, the last entry the frame count)."""
    fps = float(fps)
    return [(k, (i - bounds[k]) / fps, i / fps)
            for k in range(len(bounds) - 1) for i in range(bounds[k], bounds[k + 1])]


def scene_clock(bounds: Sequence[int], fps: float) -> tuple[list[float], list[float]]:
    """(scene_starts, scene_durations) in seconds for build_compositor, from the same `bounds`."""
    fps = float(fps)
    return [b / fps for b in bounds[:-1]], [(b - a) / fps for a, b in zip(bounds[:-1], bounds[1:])]


def logo_sprite(logo: Logo) -> np.ndarray:
    """The logo's RGBA [h, w, 4] at its own size or scaled to `logo.height` (aspect kept), even sizes."""
    w, h, duration = probe_picture(logo.image)
    if duration is not None:
        raise InputError(logo.image, "is a video; a logo is a still image (PNG keeps its transparency)")
    if logo.height:
        w, h = w * logo.height / h, logo.height
    return load_still(logo.image, (show_text.even(w), show_text.even(h)))


def logo_position(size: tuple[int, int], corner: str, margin: int, frame_size: tuple[int, int],
                  bottom_reserved: int = 0) -> tuple[int, int]:
    """Top-left (even) of a `size` logo at `corner`, `margin` px from both edges (a bottom corner sits
    above `bottom_reserved` rows: the ticker's band)."""
    (w, h), (fw, fh) = size, frame_size
    x = margin if corner.endswith("left") else fw - margin - w
    y = margin if corner.startswith("top") else fh - bottom_reserved - margin - h
    x, y = x // 2 * 2, y // 2 * 2
    if x < 0 or y < 0 or x + w > fw or y + h > fh - (0 if corner.startswith("top") else bottom_reserved):
        raise LipStreamError(f"logo: {w} x {h} px with a {margin} px margin does not fit the {fw} x {fh} frame "
                             f"at {corner}; give it a smaller height or margin")
    return x, y


def _check_box(box: tuple[int, int, int, int], frame_size: tuple[int, int], what: str) -> None:
    x1, y1, x2, y2 = box
    if not (0 <= x1 < x2 <= frame_size[0] and 0 <= y1 < y2 <= frame_size[1]):
        raise LipStreamError(f"{what}: box {list(box)} is not inside the {frame_size[0]} x {frame_size[1]} frame")


def _picture_layer(pic: Picture, when: SceneSpan, frame_size: tuple[int, int], matrix: str,
                   device: torch.device) -> Layer:
    fw, fh = frame_size
    full = pic.box is None
    box = (0, 0, fw, fh) if full else pic.box
    _check_box(box, frame_size, "cutaway" if full else "pip")
    w, h, duration = probe_picture(pic.source)
    rect = fit_box(w, h, box)
    size = (rect[2] - rect[0], rect[3] - rect[1])
    if duration is None:
        rgba = load_still(pic.source, size)
        if not full:
            return SpriteLayer(Sprite.from_rgba(rgba, matrix, device), rect[:2], when)
        canvas = Image.new("RGBA", (fw, fh), (0, 0, 0, 255))  # letterboxed / pillarboxed on black
        canvas.alpha_composite(Image.fromarray(rgba), rect[:2])
        return SpriteLayer(Sprite.from_rgba(np.asarray(canvas), matrix, device), (0, 0), when)
    bars: list[Rect] = []
    if full:
        x1, y1, x2, y2 = rect
        bars = [b for b in ((0, 0, fw, y1), (0, y2, fw, fh), (0, y1, x1, y2), (x2, y1, fw, y2))
                if b[2] > b[0] and b[3] > b[1]]
    source = VideoSource(pic.source, size, loop=pic.loop, pin=device.type == "cuda", start=when.scene == 0)
    return VideoLayer(source, rect, when, matrix, device, bars)


def build_compositor(show: Show, frame_size: tuple[int, int], fps: float, scene_starts: Sequence[float],
                     scene_durations: Sequence[float], matrix: str,
                     device: torch.device | str = "cpu") -> Compositor | None:
    """The show's layers for frames of `frame_size` (w, h, even) in `matrix` on `device`, every sprite
    rendered, converted and uploaded now (a bad file fails here, before any frame); None when the show
    paints nothing, so the render pays nothing. `scene_starts`/`scene_durations`: seconds, per scene of
    the program (a layer's `to:` defaults to its scene's end). `fps` is the frames' rate: times come with
    each batch (apply's `times`), so it only checks they are the render's."""
    if not show.visual():
        return None
    device = torch.device(device)
    fw, fh = frame_size
    if not float(fps) > 0:
        raise ValueError(f"fps {fps!r}")
    if fw % 2 or fh % 2:
        raise ValueError(f"frame_size {frame_size!r}: I420 needs even sizes")
    if len(show.scenes) > len(scene_durations) or len(scene_starts) != len(scene_durations):
        raise ValueError(f"{len(show.scenes)} scenes of layers, {len(scene_starts)} starts and "
                         f"{len(scene_durations)} durations")
    layers: list[Layer] = []
    try:
        spans = [[SceneSpan(k, x.span, scene_durations[k]) if x else None for x in (s.cutaway, s.pip, s.lower_third)]
                 for k, s in enumerate(show.scenes)]
        for k, s in enumerate(show.scenes):  # cutaways, then pips: each kind over the one before
            if s.cutaway:
                layers.append(_picture_layer(s.cutaway, spans[k][0], frame_size, matrix, device))
        for k, s in enumerate(show.scenes):
            if s.pip:
                layers.append(_picture_layer(s.pip, spans[k][1], frame_size, matrix, device))
        band_h = show_text.ticker_band_height(fh) if show.ticker else 0
        for k, s in enumerate(show.scenes):
            if s.lower_third:
                problem = show_text.lower_third_problem(s.lower_third, fw, fh, show.font)
                if problem:
                    raise LipStreamError(problem)
                rgba = show_text.lower_third_sprite(s.lower_third, fw, fh, show.font)
                x = show_text.even(LOWER_THIRD_MARGIN * fw)
                y = (fh - band_h - show_text.even(LOWER_THIRD_MARGIN * fh) - rgba.shape[0]) // 2 * 2
                layers.append(SpriteLayer(Sprite.from_rgba(rgba, matrix, device), (x, max(0, y)), spans[k][2]))
        if show.logo:
            rgba = logo_sprite(show.logo)
            at = logo_position((rgba.shape[1], rgba.shape[0]), show.logo.corner, show.logo.margin, frame_size, band_h)
            layers.append(SpriteLayer(Sprite.from_rgba(rgba, matrix, device), at, _always))
        if show.ticker:
            problem = show_text.ticker_problem(show.ticker.text, fw, fh, show.font)
            if problem:
                raise LipStreamError(problem)
            band, strip = show_text.ticker_strip(show.ticker.text, fw, fh, show.font)
            layers.append(TickerLayer(Sprite.from_rgba(band, matrix, device), Sprite.from_rgba(strip, matrix, device),
                                      frame_size, show.ticker.speed))
    except BaseException:
        for layer in layers:
            layer.close()
        raise
    return Compositor(layers, frame_size, device)
