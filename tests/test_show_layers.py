"""The show's visual layers (show/text.py, sources.py, compose.py) on real pixels, on the CPU.

Synthetic I420 frames go through Compositor.apply and come back as RGB: each layer must be at its box
and times, and every pixel outside its box, and every frame outside its span, bit-identical to the input.
Videos are real H.264 files of flat colours (one per frame), so the colour at a pip's centre says which
source frame the compositor showed at each of the show's times.
"""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from lipstream.avatar.colour import i420_to_rgb
from lipstream.errors import InputError, LipStreamError
from lipstream.show import text as show_text
from lipstream.show.build import build_compositor, frame_times, logo_position, scene_clock
from lipstream.show.compose import Planes, Sprite, SpriteLayer, TickerLayer, fade
from lipstream.show.sources import VideoSource, fit_box, probe_picture
from lipstream.show.spec import CORNERS, Logo, LowerThird, Picture, SceneLayers, Show, Span, Ticker

W, H = 640, 360
FPS = 25
MATRIX = "bt709"
PALETTE = np.array([[230, 30, 30], [30, 200, 30], [30, 30, 230], [220, 220, 40], [40, 220, 220],
                    [220, 40, 220], [250, 250, 250], [120, 60, 0]], np.uint8)


def gradient(n: int) -> torch.Tensor:
    """n I420 frames [n, H*3/2, W]: a luma gradient (each frame different) and mild chroma."""
    yy, xx = np.mgrid[0:H, 0:W]
    frames = np.empty((n, H * 3 // 2, W), np.uint8)
    for k in range(n):
        frames[k, :H] = 40 + (xx * 0.2 + yy * 0.3 + 3 * k) % 150
        frames[k, H:] = 120 + k % 5
    return torch.from_numpy(frames)


def rgb(frames: torch.Tensor) -> np.ndarray:
    return i420_to_rgb(frames, H, W, MATRIX).numpy().astype(int)


def nearest(colour: np.ndarray) -> int:
    return int(np.argmin(((PALETTE.astype(int) - colour) ** 2).sum(1)))


def write_video(path: Path, frames: int, fps: int, size: tuple[int, int] = (64, 48), pix_fmt: str = "yuv420p",
                bt709: bool = False) -> Path:
    """A lossless H.264 file whose frame k is PALETTE[k] flat (untagged BT.601, or tagged BT.709)."""
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps, options={"qp": "0", "preset": "ultrafast"})
        s.width, s.height, s.pix_fmt = size[0], size[1], pix_fmt
        if bt709:
            s.codec_context.colorspace = 1
        for k in range(frames):
            pic = np.broadcast_to(PALETTE[k % len(PALETTE)], (size[1], size[0], 3)).copy()
            frame = av.VideoFrame.from_ndarray(pic, format="rgb24")
            if bt709:
                frame = frame.reformat(format=pix_fmt, dst_colorspace="ITU709")
                frame.colorspace = 1
            for p in s.encode(frame):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return path


def write_still(path: Path, colour, size: tuple[int, int], alpha: int = 255) -> Path:
    Image.new("RGBA", size, (*colour, alpha)).save(path)
    return path


def changed(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """[n, H, W] bool: where any plane differs (chroma mapped up to its 2x2 luma pixels)."""
    y = (a[:, :H] != b[:, :H]).numpy()
    c = (a[:, H:] != b[:, H:]).numpy().reshape(a.shape[0], 2, H // 2, W // 2).any(1)
    return y | c.repeat(2, 1).repeat(2, 2)


def bbox(mask: np.ndarray) -> tuple[int, int, int, int] | None:
    ys, xs = np.nonzero(mask)
    return (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1) if len(xs) else None


def run(show: Show, times, durations=(10.0, 10.0)) -> tuple[torch.Tensor, torch.Tensor]:
    starts = list(np.cumsum([0.0, *durations[:-1]]))
    comp = build_compositor(show, (W, H), FPS, starts, list(durations), MATRIX, "cpu")
    assert comp is not None
    with comp:
        src = gradient(len(times))
        out = comp.apply(src.clone(), times)
    return src, out


def scene_times(scene: int, ts, offset: float = 0.0):
    return [(scene, float(t), float(t) + offset) for t in ts]


def test_no_layers_no_compositor():
    assert build_compositor(Show(scenes=[SceneLayers()]), (W, H), FPS, [0.0], [5.0], MATRIX) is None


def test_lower_third_at_its_box_and_times_with_fades():
    lt = LowerThird("Anna Berg", "Berlin", Span(0.5, 2.0, fade=0.2))
    show = Show(scenes=[SceneLayers(lower_third=lt), SceneLayers()])
    ts = [0.0, 0.48, 0.5, 0.6, 1.0, 1.9, 2.0, 3.0]
    times = scene_times(0, ts) + [(1, 1.0, 11.0)]
    src, out = run(show, times)
    diff = changed(src, out)
    sprite = show_text.lower_third_sprite(lt, W, H)
    sh, sw = sprite.shape[:2]
    x, y = show_text.even(0.05 * W), H - show_text.even(0.05 * H) - sh
    box = (x, y - y % 2, x + sw, y - y % 2 + sh)
    for i, t in enumerate(ts):
        if 0.5 < t < 2.0:
            assert bbox(diff[i]) == box, t  # the strap's own rectangle: its band is semi-opaque everywhere
        else:
            assert torch.equal(out[i], src[i]), t  # before `from` (and at it: the fade starts at 0), from `to`
    assert torch.equal(out[-1], src[-1])  # another scene
    assert torch.equal(out[:, :H][:, :box[1]], src[:, :H][:, :box[1]])  # everything above, bit-exact
    # the band's colour (a pixel of the band, off the text) is STRAP over the frame at its alpha
    a = show_text.STRAP_RGBA[3] / 255
    px = (box[0] + sw - 3, box[1] + 2)
    before, full, mid = rgb(src)[4][px[1], px[0]], rgb(out)[4][px[1], px[0]], rgb(out)[3][px[1], px[0]]
    expect = a * np.array(show_text.STRAP_RGBA[:3]) + (1 - a) * before
    assert np.abs(full - expect).max() <= 4
    # mid-fade (0.1 s into a 0.2 s fade): half way between the frame and the full strap
    before3 = rgb(src)[3][px[1], px[0]]
    expect_mid = 0.5 * (a * np.array(show_text.STRAP_RGBA[:3]) + (1 - a) * before3) + 0.5 * before3
    assert np.abs(mid - expect_mid).max() <= 4
    assert np.abs(mid - before3).max() > 20
    # the title is there: white, anti-aliased pixels (some in between) inside the box
    lum = rgb(out)[4][box[1]:box[3], box[0]:box[2]].mean(-1)
    assert (lum > 235).sum() > 50 and ((lum > 80) & (lum < 200)).sum() > 20


def test_lower_third_sits_above_the_ticker():
    lt = LowerThird("Anna Berg", "", Span(0.0, 5.0, fade=0.0))
    show = Show(scenes=[SceneLayers(lower_third=lt)], ticker=Ticker("x", 0.0))
    src, out = run(show, scene_times(0, [1.0]))
    band = show_text.ticker_band_height(H)
    column = show_text.even(0.05 * W) + 4  # a column the lower third covers (the ticker's text is off screen)
    rows = np.nonzero(changed(src, out)[0][:, column])[0]
    assert rows.max() == H - 1 and rows.min() < H - band - 10
    gap = [r for r in range(rows.min(), H) if r not in set(rows)]
    assert gap and min(gap) < H - band  # untouched rows between the strap and the band


def test_ticker_scrolls_at_its_speed():
    speed = 120.0
    show = Show(ticker=Ticker("Breaking: markets closed higher today.", speed))
    band = show_text.ticker_band_height(H)
    ts = [0.5, 1.5, 2.25]
    src, out = run(show, [(0, t, t) for t in ts])
    diff = changed(src, out)
    for i in range(len(ts)):
        assert bbox(diff[i]) == (0, H - band, W, H)  # the band, full width, at the bottom; nothing else
        assert torch.equal(out[i, :H - band], src[i, :H - band])
    lefts = []
    for i in range(len(ts)):
        lum = rgb(out)[i][H - band:].mean(-1)
        cols = np.nonzero((lum > 200).any(0))[0]  # the white text on the dark band
        lefts.append(cols.min())
    assert abs(lefts[0] - (W - speed * ts[0])) <= 6  # starts at the right edge
    assert abs((lefts[0] - lefts[1]) - speed * 1.0) <= 2
    assert abs((lefts[1] - lefts[2]) - speed * 0.75) <= 2


def test_the_ticker_tape_equals_band_then_text_within_one_code_value():
    """The ticker paints band and text as one pre-combined tape: the same as the band blended, then the
    text over it (each rounded), within the one rounding it saves."""
    band, strip = show_text.ticker_strip("Breaking: markets closed higher today.", W, H)
    band_s, strip_s = (Sprite.from_rgba(x, MATRIX, torch.device("cpu")) for x in (band, strip))
    layer = TickerLayer(band_s, strip_s, (W, H), 120.0)
    xs = [W - 40, 200, 0, -strip.shape[1] + 60, -strip.shape[1] - 10]  # entering, across, leaving, gone
    src = gradient(len(xs))
    out = src.clone()
    layer.paint(Planes.of(out, H, W), 0, len(xs), None, torch.tensor(xs, dtype=torch.float32))
    top, sw = H - band.shape[0], strip.shape[1]
    for i, x in enumerate(xs):  # the reference: two blends of the sprites, frame by frame
        ref = src[i:i + 1].clone()
        planes = Planes.of(ref, H, W)
        SpriteLayer(band_s, (0, top), lambda ft: 1.0).paint(planes, 0, 1, None, torch.zeros(1))
        a, b = max(0, x), min(W, x + sw)
        if b > a:
            for plane, t, lo_, hi_, pre, alpha in ((planes.y, top, a, b, strip_s.y, strip_s.a),
                                                   (planes.u, top // 2, a // 2, b // 2, strip_s.u, strip_s.ac),
                                                   (planes.v, top // 2, a // 2, b // 2, strip_s.v, strip_s.ac)):
                off = (x if plane is planes.y else x // 2)
                region = plane[:, t:, lo_:hi_]
                region.copy_((region.float() * (1 - alpha[:, lo_ - off:hi_ - off])
                              + pre[:, lo_ - off:hi_ - off]).round_().clamp_(0, 255))
        assert (out[i].int() - ref[0].int()).abs().max() <= 1, x
        assert torch.equal(out[i, :top], src[i, :top])
    assert not torch.equal(out[0], out[1])


def test_a_fully_shown_layer_gives_the_faded_paths_bits_at_opacity_one(tmp_path):
    """Fully shown layers skip the fade's arithmetic (opacity None): the same bits as opacity 1."""
    logo = write_still(tmp_path / "logo.png", (255, 200, 0), (60, 30), alpha=180)
    clip = write_video(tmp_path / "clip.mp4", 8, 10)
    show = Show(scenes=[SceneLayers(pip=Picture(clip, (100, 60, 260, 180), Span(0.0, 9.0, fade=0.0)))],
                logo=Logo(logo, corner="top-left", margin=16))
    times = scene_times(0, [0.5, 0.54, 0.58])
    results = []
    for full in (True, False):
        comp = build_compositor(show, (W, H), FPS, [0.0], [10.0], MATRIX, "cpu")
        with comp:
            src = gradient(len(times))
            out = src.clone()
            planes = Planes.of(out, H, W)
            for layer in comp.layers:
                op, aux = layer.plan(times)
                assert op == [1.0] * len(times)
                layer.stage()
                layer.paint(planes, 0, len(times), None if full else torch.ones(len(times)), torch.tensor(aux))
        results.append(out)
    assert torch.equal(results[0], results[1]) and not torch.equal(results[0], src)


def test_ticker_wraps_after_passing():
    show = Show(ticker=Ticker("Short", 200.0))
    _, strip = show_text.ticker_strip("Short", W, H)
    period = (strip.shape[1] + W) / 200.0
    src, out = run(show, [(0, 0.0, 0.0), (0, period * 0.999, period * 0.999), (0, period + 0.5, period + 0.5)])
    band = show_text.ticker_band_height(H)
    text = [(rgb(out)[i][H - band:].mean(-1) > 200).any(0) for i in range(3)]
    assert not text[0].any() and not text[1].any()  # just entering at the right / just left at the left
    assert abs(np.nonzero(text[2])[0].min() - (W - 100)) <= 6  # round again: 0.5 s in


@pytest.mark.parametrize("corner", CORNERS)
def test_logo_at_its_corner(tmp_path, corner):
    logo = write_still(tmp_path / "logo.png", (255, 200, 0), (60, 30))
    show = Show(logo=Logo(logo, corner=corner, margin=20))
    src, out = run(show, [(0, 0.0, 0.0), (0, 3.0, 3.0)])
    x = 20 if corner.endswith("left") else W - 20 - 60
    y = 20 if corner.startswith("top") else H - 20 - 30
    for i in range(2):
        assert bbox(changed(src, out)[i]) == (x, y, x + 60, y + 30)
        assert np.abs(rgb(out)[i][y + 15, x + 30] - [255, 200, 0]).max() <= 4


def test_logo_scaled_to_height_and_above_the_ticker(tmp_path):
    logo = write_still(tmp_path / "logo.png", (0, 200, 255), (100, 50))
    show = Show(logo=Logo(logo, corner="bottom-right", margin=16, height=40), ticker=Ticker("News", 0.0))
    src, out = run(show, [(0, 1.0, 1.0)])
    band = show_text.ticker_band_height(H)
    y2 = H - band - 16
    box = bbox(changed(src, out)[0][:H - band])
    assert box == (W - 16 - 80, y2 - 40, W - 16, y2)
    with pytest.raises(LipStreamError, match="does not fit"):
        logo_position((700, 40), "top-left", 10, (W, H))


def test_transparent_png_logo_keeps_alpha(tmp_path):
    logo = write_still(tmp_path / "logo.png", (255, 255, 255), (40, 40), alpha=128)
    src, out = run(Show(logo=Logo(logo, corner="top-left", margin=10)), [(0, 0.0, 0.0)])
    before, after = rgb(src)[0][30, 30], rgb(out)[0][30, 30]
    assert np.abs(after - (0.5 * 255 + 0.5 * before)).max() <= 4


def test_pip_video_frames_follow_the_show_clock_and_hold(tmp_path):
    video = write_video(tmp_path / "clip.mp4", 8, 10)  # 0.8 s, frame k = PALETTE[k]
    box = (400, 40, 600, 200)
    pip = Picture(video, box, Span(0.4, 3.0, fade=0.0))
    show = Show(scenes=[SceneLayers(pip=pip)])
    ts = [k / FPS for k in range(0, 80)]
    src, out = run(show, scene_times(0, ts))
    rect = fit_box(64, 48, box)
    cx, cy = (rect[0] + rect[2]) // 2, (rect[1] + rect[3]) // 2
    pixels = rgb(out)
    diff = changed(src, out)
    for i, t in enumerate(ts):
        if 0.4 <= t < 3.0:
            k = min(int(np.floor((t - 0.4) * 10 + 1e-6)), 7)  # the frame covering t; past the end, the last
            assert nearest(pixels[i][cy, cx]) == k, t
            assert np.abs(pixels[i][cy, cx] - PALETTE[k]).max() <= 6
            assert bbox(diff[i]) == rect
        else:
            assert torch.equal(out[i], src[i]), t


@pytest.mark.slow
def test_pip_video_loops_and_uploads_each_frame_once(tmp_path):
    video = write_video(tmp_path / "clip.mp4", 8, 10)
    pip = Picture(video, (0, 0, 128, 96), Span(0.0, None, fade=0.0), loop=True)
    show = Show(scenes=[SceneLayers(pip=pip)])
    comp = build_compositor(show, (W, H), FPS, [0.0], [4.0], MATRIX)
    ts = [k / FPS for k in range(100)]
    seen = []
    with comp:
        for start in range(0, 100, 16):  # batches, as the render sends them
            batch = ts[start:start + 16]
            out = comp.apply(gradient(len(batch)), scene_times(0, batch))
            seen += [nearest(p[48, 64]) for p in rgb(out)]
        uploads = comp.layers[0].uploads
    assert seen == [int(np.floor(t * 10 + 1e-6)) % 8 for t in ts]
    assert uploads == len({int(np.floor(t * 10 + 1e-6)) for t in ts})  # once per source frame shown


@pytest.mark.parametrize("raw", [True, False])
def test_pip_video_higher_rate_than_the_show(tmp_path, raw):
    video = write_video(tmp_path / "clip.mp4", 24, 60)  # 0.4 s at 60 fps
    source = VideoSource(video, (32, 24), raw=raw)
    try:
        got = [nearest(source.frame_at(k / FPS).rgb((32, 24))[12, 16]) for k in range(10)]
        assert source.frame_at(1.0).layout == ("i420" if raw else "rgb")
    finally:
        source.close()
    assert got == [min(int(np.floor(k * 60 / FPS + 1e-6)), 23) % 8 for k in range(10)]  # 2.4 frames a frame


@pytest.mark.parametrize("kind", ["bt709", "yuv444p"])
def test_pip_video_other_matrices_and_formats(tmp_path, kind):
    """A BT.709-tagged clip (scaled on the device, no re-matrixing) and a 4:4:4 one (swscale's RGB)."""
    video = write_video(tmp_path / "clip.mp4", 8, 10, pix_fmt="yuv444p" if kind == "yuv444p" else "yuv420p",
                        bt709=kind == "bt709")
    with av.open(str(video)) as c:
        first = next(c.decode(video=0))
        assert (first.format.name, int(first.colorspace)) == (
            ("yuv420p", 1) if kind == "bt709" else ("yuv444p", first.colorspace))
    box = (100, 100, 300, 250)
    show = Show(scenes=[SceneLayers(pip=Picture(video, box, Span(0.0, None, fade=0.0)))])
    ts = [k / FPS for k in range(0, 20, 3)]
    src, out = run(show, scene_times(0, ts))
    rect = fit_box(64, 48, box)
    cx, cy = (rect[0] + rect[2]) // 2, (rect[1] + rect[3]) // 2
    for i, t in enumerate(ts):
        k = int(t * 10 + 1e-6)
        assert np.abs(rgb(out)[i][cy, cx] - PALETTE[k]).max() <= 6, t
        assert bbox(changed(src, out)[i]) == rect


def test_pip_still_fits_its_box_keeping_aspect(tmp_path):
    still = write_still(tmp_path / "chart.png", (0, 180, 255), (300, 100))  # 3:1 in a 200 x 160 box
    box = (100, 50, 300, 210)
    show = Show(scenes=[SceneLayers(pip=Picture(still, box, Span(0.0, 2.0, fade=0.0)))])
    src, out = run(show, scene_times(0, [1.0]))
    rect = bbox(changed(src, out)[0])
    assert rect == fit_box(300, 100, box) == (100, 96, 300, 162)  # full width, 66 rows, centred
    assert np.abs(rgb(out)[0][130, 200] - [0, 180, 255]).max() <= 4


def test_fit_box():
    assert fit_box(1920, 1080, (0, 0, 640, 360)) == (0, 0, 640, 360)
    assert fit_box(1080, 1920, (0, 0, 640, 360)) == (218, 0, 420, 360)  # tall: pillarboxed, centred
    assert fit_box(100, 100, (11, 11, 51, 31)) == (22, 12, 40, 30)  # odd corners pulled in to even ones
    for box in ((10, 20, 333, 207), (0, 0, 1000, 30)):
        x1, y1, x2, y2 = fit_box(640, 480, box)
        assert x1 % 2 == y1 % 2 == x2 % 2 == y2 % 2 == 0
        assert box[0] <= x1 < x2 <= box[2] and box[1] <= y1 < y2 <= box[3]


def test_cutaway_still_letterboxed_on_black(tmp_path):
    still = write_still(tmp_path / "chart.png", (200, 40, 40), (400, 100))  # 4:1 on a 16:9 frame
    show = Show(scenes=[SceneLayers(), SceneLayers(cutaway=Picture(still, None, Span(1.0, 3.0, fade=0.0)))])
    src, out = run(show, [(1, 0.5, 10.5), (1, 2.0, 12.0), (0, 2.0, 2.0)])
    assert torch.equal(out[0], src[0]) and torch.equal(out[2], src[2])
    pixels = rgb(out)[1]
    rect = fit_box(400, 100, (0, 0, W, H))
    assert np.abs(pixels[H // 2, W // 2] - [200, 40, 40]).max() <= 4
    assert pixels[: rect[1] - 1].max() <= 3 and pixels[rect[3] + 1:].max() <= 3  # black bars above and below
    y = out[1, :H].numpy()
    assert (y[: rect[1]] == 16).all() and (y[rect[3]:] == 16).all()  # limited-range black


def test_cutaway_video_pillarboxed_with_fade(tmp_path):
    video = write_video(tmp_path / "tall.mp4", 8, 10, size=(48, 64))
    show = Show(scenes=[SceneLayers(cutaway=Picture(video, None, Span(0.0, 2.0, fade=0.4)))])
    src, out = run(show, scene_times(0, [0.2, 1.0]))
    rect = fit_box(48, 64, (0, 0, W, H))
    y = out[:, :H].numpy()
    assert (y[1, :, : rect[0]] == 16).all() and (y[1, :, rect[2]:] == 16).all()
    assert nearest(rgb(out)[1][H // 2, W // 2]) == 7  # held: the last of 8 frames (0.7 s) at 1.0 s
    # half-way through the fade in: the bars are half black over the frame
    half = 0.5 * src[0, :H, :rect[0]].float() + 0.5 * 16
    assert (out[0, :H, :rect[0]].float() - half).abs().max() <= 1


def test_frame_times_from_render_bounds():
    times = frame_times([0, 3, 5], 25)
    assert times == [(0, 0.0, 0.0), (0, 0.04, 0.04), (0, 0.08, 0.08), (1, 0.0, 0.12), (1, 0.04, 0.16)]
    assert scene_clock([0, 3, 5], 25) == ([0.0, 0.12], [0.12, 0.08])


def test_fade_ramp():
    span = Span(1.0, None, fade=0.5)
    assert [fade(span, 4.0, t) for t in (0.9, 1.0, 1.25, 1.5, 3.0, 3.75, 4.0)] == [0, 0, 0.5, 1, 1, 0.5, 0]
    assert fade(Span(0.0, 1.0, fade=0.0), 1.0, 0.0) == 1.0


def test_frames_outside_boxes_bit_identical_with_every_layer(tmp_path):
    video = write_video(tmp_path / "clip.mp4", 8, 10)
    logo = write_still(tmp_path / "logo.png", (255, 200, 0), (40, 20))
    show = Show(scenes=[SceneLayers(lower_third=LowerThird("Anna Berg", "Berlin"),
                                    pip=Picture(video, (420, 60, 620, 200)))],
                logo=Logo(logo, corner="top-left", margin=16), ticker=Ticker("Breaking news", 100.0))
    src, out = run(show, scene_times(0, [0.5, 1.0, 1.5]))
    keep = np.ones((H, W), bool)
    keep[H - show_text.ticker_band_height(H):] = False
    keep[16:36, 16:56] = False
    keep[60:200, 420:620] = False
    keep[H // 2:, : W // 2] = False  # the lower third's quarter
    diff = changed(src, out)
    assert not (diff & keep[None]).any()
    assert diff.any(axis=(1, 2)).all()


def test_probe_and_errors(tmp_path):
    video = write_video(tmp_path / "clip.mp4", 8, 10)
    w, h, d = probe_picture(video)
    assert (w, h) == (64, 48) and abs(d - 0.8) < 0.05
    assert probe_picture(write_still(tmp_path / "s.png", (1, 2, 3), (30, 20))) == (30, 20, None)
    with pytest.raises(InputError, match="no such picture"):
        probe_picture(tmp_path / "missing.mp4")
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"this is not a video\n" * 50)
    with pytest.raises(InputError, match="cannot decode|can decode") as e:
        probe_picture(junk)
    assert "\n" not in str(e.value) and str(junk) in str(e.value)
    bad_png = tmp_path / "bad.png"
    bad_png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    with pytest.raises(InputError):
        probe_picture(bad_png)
    show = Show(scenes=[SceneLayers(pip=Picture(tmp_path / "gone.mp4", (0, 0, 100, 100)))])
    with pytest.raises(InputError, match="gone.mp4: no such picture"):
        build_compositor(show, (W, H), FPS, [0.0], [5.0], MATRIX)
    with pytest.raises(LipStreamError, match="not inside"):
        build_compositor(Show(scenes=[SceneLayers(pip=Picture(video, (500, 0, 700, 100)))]), (W, H), FPS,
                         [0.0], [5.0], MATRIX)
    with pytest.raises(InputError, match="font"):
        show_text.load_font(junk, 20)


def test_text_fits_and_sprites_are_even():
    lt = LowerThird("Anna Berg", "Berlin")
    assert show_text.lower_third_problem(lt, W, H) is None
    long = LowerThird("A very long title for a name strap, one that runs on and on past the frame", "x")
    problem = show_text.lower_third_problem(long, W, H)
    assert problem and "80%" in problem and "\n" not in problem
    with pytest.raises(LipStreamError, match="wide"):
        build_compositor(Show(scenes=[SceneLayers(lower_third=long)]), (W, H), FPS, [0.0], [5.0], MATRIX)
    assert show_text.lower_third_problem(LowerThird("   "), W, H)
    assert show_text.ticker_problem("  ", W, H) and show_text.ticker_problem("ok", W, H) is None
    for sprite in (show_text.lower_third_sprite(lt, W, H), *show_text.ticker_strip("Breaking: news", W, H),
                   show_text.lower_third_sprite(LowerThird("Ab", "c"), 1920, 1080)):
        assert sprite.shape[0] % 2 == 0 and sprite.shape[1] % 2 == 0 and sprite.shape[2] == 4
    small, big = (show_text.lower_third_sprite(lt, w, h) for w, h in ((640, 360), (1920, 1080)))
    assert 2.5 < big.shape[0] / small.shape[0] < 3.5  # scales with the frame


def test_through_a_real_encode_and_decode(tmp_path):
    from lipstream.media.mp4 import MP4Writer

    video = write_video(tmp_path / "clip.mp4", 8, 10)
    logo = write_still(tmp_path / "logo.png", (255, 200, 0), (80, 40))
    box = (400, 40, 600, 190)
    show = Show(scenes=[SceneLayers(pip=Picture(video, box, Span(0.0, None, fade=0.0)))],
                logo=Logo(logo, corner="top-left", margin=20))
    n = 10
    comp = build_compositor(show, (W, H), FPS, [0.0], [n / FPS], MATRIX)
    with comp:
        frames = comp.apply(gradient(n), scene_times(0, [k / FPS for k in range(n)]))
    out = tmp_path / "show.mp4"
    with MP4Writer(out, W, H, FPS, np.zeros(48000 * n // FPS, np.float32), matrix=MATRIX, crf=18,
                   x264_preset="ultrafast", total_frames=n) as w:
        for f in frames.numpy():
            w.write(f)
    rect = fit_box(64, 48, box)
    cx, cy = (rect[0] + rect[2]) // 2, (rect[1] + rect[3]) // 2
    with av.open(str(out)) as c:
        decoded = [torch.from_numpy(f.to_ndarray(format="yuv420p")) for f in c.decode(video=0)]
    assert len(decoded) == n
    pixels = rgb(torch.stack(decoded))
    for k in range(n):
        assert nearest(pixels[k][cy, cx]) == int(k / FPS * 10 + 1e-6)
        assert np.abs(pixels[k][40, 60] - [255, 200, 0]).max() <= 12  # the logo, inside its box


def test_decoded_planes_copied_exactly(tmp_path):
    """The decoder thread's own plane copy (into pinned memory on CUDA) is PyAV's packed I420, padded
    lines (a 202 px wide frame: 256-byte lines) included."""
    from lipstream.show.sources import _i420

    video = write_video(tmp_path / "odd.mp4", 3, 10, size=(202, 150))
    with av.open(str(video)) as c:
        for frame in c.decode(video=0):
            assert frame.planes[0].line_size != 202
            assert np.array_equal(_i420(frame, False).pixels, frame.to_ndarray())


def test_video_decoder_starts_a_scene_ahead_and_stops_after(tmp_path):
    video = write_video(tmp_path / "clip.mp4", 8, 10)
    show = Show(scenes=[SceneLayers(), SceneLayers(), SceneLayers(pip=Picture(video, (0, 0, 64, 48))), SceneLayers()])
    comp = build_compositor(show, (W, H), FPS, [0.0, 1.0, 2.0, 3.0], [1.0] * 4, MATRIX)
    source = comp.layers[0].source
    with comp:
        comp.apply(gradient(1), [(0, 0.5, 0.5)])
        assert not source.started  # two scenes ahead: nothing decoded, nothing held
        comp.apply(gradient(1), [(1, 0.5, 1.5)])
        assert source.started
        src = gradient(1)
        out = comp.apply(src.clone(), [(2, 0.5, 2.5)])
        assert nearest(rgb(out)[0][24, 32]) == 5
        comp.apply(gradient(1), [(3, 0.1, 3.1)])
        assert not source.started


@pytest.mark.slow
def test_graphed_whole_batches_give_the_eager_bits(tmp_path, monkeypatch):
    """On CUDA a batch is painted whole by a captured graph (every layer over every frame, opacity 0 where it
    hides): here played by the CPU stand-in, batch after batch of 8, 16 and 32 frames and a short tail, as
    layers fade in and out, a video pip changes frames and holds one across batches, the ticker moves. The
    frames equal the eager path's (each layer over the frames it shows in) to the bit."""
    from conftest import _ReplayGraph

    from lipstream.show import compose

    monkeypatch.setattr(compose, "_Graph", _ReplayGraph)
    clip = write_video(tmp_path / "clip.mp4", 8, 10)
    logo = write_still(tmp_path / "logo.png", (255, 200, 0), (60, 30), alpha=180)
    chart = write_still(tmp_path / "chart.png", (20, 120, 220), (160, 90))
    show = Show(scenes=[SceneLayers(pip=Picture(clip, (400, 40, 600, 200), Span(0.3, 2.2, fade=0.2), loop=True),
                                    lower_third=LowerThird("Anna Berg", "Berlin", Span(0.1, 1.0, fade=0.24)),
                                    cutaway=Picture(chart, None, Span(1.5, 1.9, fade=0.08)))],
                logo=Logo(logo, corner="top-right", margin=16), ticker=Ticker("Breaking: tests pass", speed=90))
    sizes = [8, 8, 16, 32, 5]
    ts = [k / FPS for k in range(sum(sizes))]
    outs = {}
    for graphs in (False, True):
        comp = build_compositor(show, (W, H), FPS, [0.0], [3.0], MATRIX, "cpu")
        comp.graphs = graphs
        frames, start = [], 0
        with comp:
            for n in sizes:
                src = gradient(n)
                frames.append(comp.apply(src, scene_times(0, ts[start:start + n])).clone())
                start += n
            if graphs:  # a graph a batch size (the tail takes 8's); 16's went when the pip's buffers grew for 32
                assert sorted(comp._captured) == [8, 32]
        outs[graphs] = torch.cat(frames)
    assert torch.equal(outs[True], outs[False])
    assert not torch.equal(outs[False], torch.cat([gradient(n) for n in sizes]))
