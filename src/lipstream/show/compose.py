"""The show's layers painted into the render's I420 batches on the device, in the render's own pass.

Blending happens in YUV, in the frames' own matrix: each sprite is converted once (RGB -> limited-range
Y, U, V, premultiplied by its alpha; chroma and alpha averaged 2x2 to the chroma planes), and a frame
only pays `out = s*sprite + (1 - s*alpha)*frame` over the sprite's box, for the frames of the batch
where it shows (s: the fade). Everything outside the boxes, and every frame where a layer does not
show, is left untouched to the bit. Order: cutaway, pip, lower third, logo, ticker.

Per batch the CPU works out each layer's opacity per frame (and the ticker's offset, a video's frame) and
uploads them as one small tensor. Each op is a kernel launch on the render's producer thread, which shares
the GIL with the encoders' feeder, so on CUDA the batch is painted by one captured graph (every layer over
the whole batch, opacity 0 leaving a frame's bits alone): one launch instead of ~150. The ticker's band and
text are one pre-combined tape; without graphs (the CPU) a layer shown fully skips the fade's arithmetic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from lipstream.avatar.colour import rgb_to_yuv, split_i420
from lipstream.engine.graphs import _Graph
from lipstream.media.pixels import yuv_to_rgb_affine
from lipstream.show.sources import SourceFrame, VideoSource
from lipstream.show.spec import Span

log = logging.getLogger(__name__)

FrameTime = tuple[int, float, float]  # (scene index, seconds since that scene's start, seconds since the show's)
Rect = tuple[int, int, int, int]  # x1, y1, x2, y2 (exclusive), even


@dataclass
class Planes:
    """Views of a batch's Y [B, H, W], U and V [B, H/2, W/2]: writing them writes the batch."""

    y: torch.Tensor
    u: torch.Tensor
    v: torch.Tensor

    @classmethod
    def of(cls, frames: torch.Tensor, height: int, width: int) -> "Planes":
        return cls(*split_i420(frames, height, width))


@dataclass
class Sprite:
    """An RGBA picture as premultiplied Y, U, V (code values) and alpha at luma and chroma resolution."""

    y: torch.Tensor  # [h, w] float: Y * alpha
    u: torch.Tensor  # [h/2, w/2] float: mean over 2x2 of U * alpha
    v: torch.Tensor
    a: torch.Tensor  # [h, w] float in [0, 1]
    ac: torch.Tensor  # [h/2, w/2]: alpha averaged 2x2
    keep: torch.Tensor  # 1 - a: what a fully shown sprite leaves of the frame
    keepc: torch.Tensor  # 1 - ac

    @classmethod
    def from_rgba(cls, rgba: np.ndarray, matrix: str, device: torch.device) -> "Sprite":
        """[h, w, 4] (or 3: opaque) uint8 with even h and w -> a Sprite on `device`."""
        t = torch.from_numpy(np.array(rgba, dtype=np.uint8, copy=True)).to(device)
        rgb = t[..., :3].permute(2, 0, 1).float() / 255
        a = t[..., 3].float() / 255 if t.shape[-1] == 4 else torch.ones(t.shape[:2], device=device)
        yuv = rgb_to_yuv(rgb, matrix) * a
        pool = lambda x: F.avg_pool2d(x[None], 2)[0]  # noqa: E731
        chroma = pool(yuv[1:])
        ac = pool(a[None])[0].contiguous()
        return cls(yuv[0].contiguous(), chroma[0].contiguous(), chroma[1].contiguous(), a.contiguous(), ac,
                   (1 - a).contiguous(), (1 - ac).contiguous())

    @property
    def size(self) -> tuple[int, int]:
        return self.y.shape[1], self.y.shape[0]


def _blend(region: torch.Tensor, pre: torch.Tensor, alpha: torch.Tensor, keep: torch.Tensor,
           s: torch.Tensor | None) -> None:
    """region [n, h, w] uint8 (a view, written in place) <- s*pre + (1 - s*alpha)*region; s [n, 1, 1], or
    None for fully shown: then `keep` (1 - alpha) gives the same bits in three ops fewer."""
    if s is None:
        out = region.float().mul_(keep).add_(pre)
    else:
        out = region.float().mul_(1 - alpha * s).add_(pre * s)
    region.copy_(out.round_().clamp_(0, 255))


def _paint_sprite(planes: Planes, lo: int, hi: int, sprite: Sprite, x: int, y: int, s: torch.Tensor | None) -> None:
    """Blend `sprite` at (x, y) (even) into frames lo:hi, with opacity s [hi-lo] (None: fully shown)."""
    w, h = sprite.size
    s = None if s is None else s.view(-1, 1, 1)
    _blend(planes.y[lo:hi, y:y + h, x:x + w], sprite.y, sprite.a, sprite.keep, s)
    cx, cy, cw, ch = x // 2, y // 2, w // 2, h // 2
    _blend(planes.u[lo:hi, cy:cy + ch, cx:cx + cw], sprite.u, sprite.ac, sprite.keepc, s)
    _blend(planes.v[lo:hi, cy:cy + ch, cx:cx + cw], sprite.v, sprite.ac, sprite.keepc, s)


class Layer(Protocol):
    """One kind of thing painted over the presenters. `plan` runs on the CPU per batch: each frame's
    opacity (0: not painted) and a layer-specific number (the ticker's x, a video's frame), or None when
    the layer shows in none of the batch's frames. `stage` uploads what that plan needs into the layer's
    own buffers on the device (a video's frames; the others have nothing). `paint` blends frames lo:hi with
    those numbers as tensors on the device; opacity is None when every frame lo:hi shows the layer fully.
    A frame of opacity 0 comes out of `paint` untouched to the bit, so a batch may be painted whole: the
    same ops every batch, which a CUDA graph replays (Compositor)."""

    def plan(self, times: Sequence[FrameTime]) -> tuple[list[float], list[float]] | None: ...

    def stage(self) -> None: ...

    def paint(self, planes: Planes, lo: int, hi: int, opacity: torch.Tensor | None, aux: torch.Tensor) -> None: ...

    def close(self) -> None: ...


def fade(span: Span, end: float, t: float) -> float:
    """Opacity at `t` seconds into the scene of a layer shown over [span.start, end): 0 before and from
    `end`, a linear ramp over span.fade seconds after the start and before the end, 1 between."""
    if t < span.start or t >= end:
        return 0.0
    if span.fade <= 0:
        return 1.0
    return max(0.0, min(1.0, (t - span.start) / span.fade, (end - t) / span.fade))


class SceneSpan:
    """When a per-scene layer shows: scene `scene`, over its span (end None: the scene's end)."""

    def __init__(self, scene: int, span: Span, scene_duration: float):
        self.scene, self.span = scene, span
        self.end = min(span.end if span.end is not None else scene_duration, scene_duration)

    def __call__(self, ft: FrameTime) -> float:
        return fade(self.span, self.end, ft[1]) if ft[0] == self.scene else 0.0


def _always(ft: FrameTime) -> float:
    return 1.0


class SpriteLayer:
    """A fixed sprite at a fixed place: a lower third, the logo, a still pip or cutaway."""

    def __init__(self, sprite: Sprite, at: tuple[int, int], when: Callable[[FrameTime], float]):
        self.sprite, self.at, self.when = sprite, at, when

    def plan(self, times: Sequence[FrameTime]) -> tuple[list[float], list[float]] | None:
        op = [self.when(t) for t in times]
        return (op, [0.0] * len(op)) if any(op) else None

    def stage(self) -> None:
        pass

    def paint(self, planes: Planes, lo: int, hi: int, opacity: torch.Tensor | None, aux: torch.Tensor) -> None:
        _paint_sprite(planes, lo, hi, self.sprite, *self.at, opacity)

    def close(self) -> None:
        pass


class TickerLayer:
    """The band at the bottom and the text strip scrolling over it, right to left: at show time t the
    strip's left edge is at W - (speed * t mod (strip width + W)), so it enters at the right edge, leaves
    at the left and starts again. Offsets are even (chroma), so the text moves in steps of 2 px.

    The band is one colour across, so band and text are combined once into a tape (premultiplied colour
    and what is kept of the frame: text over band, one band-only column at each end) and a frame column
    takes the tape's column under it: one gather and one blend per plane. The ticker never fades."""

    def __init__(self, band: Sprite, strip: Sprite, frame_size: tuple[int, int], speed: float):
        self.band, self.strip, self.speed = band, strip, float(speed)
        self.width, self.height = frame_size
        self.top = self.height - band.size[1]
        dev = band.y.device
        self._cols = torch.arange(1, self.width + 1, device=dev)  # + 1: the tape's band-only first column
        self._ccols = torch.arange(1, self.width // 2 + 1, device=dev)

        def tape(b_pre, b_keep, s_pre, s_keep):  # band [h, 1], strip [h, w] -> [h, w + 2]
            pre = torch.cat([b_pre, s_pre + s_keep * b_pre, b_pre], 1)
            keep = torch.cat([b_keep, s_keep * b_keep, b_keep], 1)
            return pre.contiguous(), keep.contiguous()

        self._tapes = (tape(band.y[:, :1], band.keep[:, :1], strip.y, strip.keep),
                       tape(band.u[:, :1], band.keepc[:, :1], strip.u, strip.keepc),
                       tape(band.v[:, :1], band.keepc[:, :1], strip.v, strip.keepc))

    def x_at(self, show_t: float) -> int:
        """The strip's left edge (even) at `show_t`."""
        period = self.strip.size[0] + self.width
        return 2 * round((self.width - (self.speed * show_t) % period) / 2)

    def plan(self, times: Sequence[FrameTime]) -> tuple[list[float], list[float]] | None:
        return [1.0] * len(times), [float(self.x_at(t[2])) for t in times]

    def stage(self) -> None:
        pass

    def paint(self, planes: Planes, lo: int, hi: int, opacity: torch.Tensor | None, aux: torch.Tensor) -> None:
        x = aux.long()[:, None]
        sw = self.strip.size[0]
        idx = (self._cols[None] - x).clamp_(0, sw + 1)  # [n, W]: the tape's column under each frame column
        cidx = (self._ccols[None] - x // 2).clamp_(0, sw // 2 + 1)
        for plane, top, at, (pre, keep) in ((planes.y, self.top, idx, self._tapes[0]),
                                            (planes.u, self.top // 2, cidx, self._tapes[1]),
                                            (planes.v, self.top // 2, cidx, self._tapes[2])):
            gather = lambda m: m[:, at].permute(1, 0, 2)  # noqa: E731  [h, T] -> [n, h, W]
            # the ticker never fades (its plan's opacity is 1 everywhere): the fully shown blend
            _blend(plane[lo:hi, top:top + pre.shape[0]], gather(pre), None, gather(keep), None)

    def close(self) -> None:
        pass


class VideoLayer:
    """A video pip or cutaway: the frame of the source shown at each output frame's time, in `rect`,
    opaque (times the fade); a cutaway also paints `bars` black. A decoded frame is uploaded once, when
    it first shows (a frame held across batches is kept on the device)."""

    def __init__(self, source: VideoSource, rect: Rect, when: SceneSpan, matrix: str, device: torch.device,
                 bars: Sequence[Rect] = ()):
        self.source, self.rect, self.when, self.matrix, self.device = source, rect, when, matrix, device
        self.cuda = device.type == "cuda"
        w, h = rect[2] - rect[0], rect[3] - rect[1]
        black = np.zeros((2, 2, 3), np.uint8)
        self.bars = [(SpriteLayer(Sprite.from_rgba(np.broadcast_to(black[:1, :1], (b[3] - b[1], b[2] - b[0], 3)),
                                                    matrix, device), (b[0], b[1]), when)) for b in bars]
        self._staged: list[SourceFrame] = []
        self._cached: tuple[int, tuple[torch.Tensor, ...]] | None = None  # (source index, YUV planes [1, ...])
        self._staged_index: list[int] = []
        self._src: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # the staged frames' Y, U, V
        self.size = (w, h)
        self.uploads = 0  # frames uploaded (tests read it)

    def reserve(self, frames: int) -> bool:
        """Room for a batch's `frames` staged pictures in the layer's source buffers (zeros: a picture
        that shows nowhere stays finite); True when they were made anew (a captured paint read the old)."""
        if self._src is not None and self._src[0].shape[0] >= frames:
            return False
        w, h = self.size
        self._src = (torch.zeros((frames, h, w), device=self.device),
                     torch.zeros((frames, h // 2, w // 2), device=self.device),
                     torch.zeros((frames, h // 2, w // 2), device=self.device))
        return True

    def stage(self) -> None:
        """The planned batch's pictures into the source buffers (the one already there reused)."""
        planes = self._upload()
        k = planes[0].shape[0]
        self.reserve(k)
        for dst, src in zip(self._src, planes):
            dst[:k].copy_(src)

    def plan(self, times: Sequence[FrameTime]) -> tuple[list[float], list[float]] | None:
        scenes = {ft[0] for ft in times}
        if not self.source.started and max(scenes) >= self.when.scene - 1:
            self.source.start()  # from the scene before: decoded ahead by the time it shows
        if self.source.started and min(scenes) > self.when.scene:
            self.source.close()  # its scene is over: the decoder and its pinned frames go
        op = [self.when(t) for t in times]
        if not any(op):
            return None
        self._staged, self._staged_index = [], []
        aux = [0.0] * len(op)
        for i, (ft, o) in enumerate(zip(times, op)):
            if o <= 0:
                continue
            picture = self.source.frame_at(ft[1] - self.when.span.start)
            if not self._staged_index or self._staged_index[-1] != self.source.index:
                self._staged.append(picture)
                self._staged_index.append(self.source.index)
            aux[i] = float(len(self._staged) - 1)
        return op, aux

    def _upload(self) -> tuple[torch.Tensor, ...]:
        """The staged frames as (Y, U, V) [k, ...] float at the rect's size on the device, the cached
        one reused."""
        reuse = self._cached is not None and self._cached[0] == self._staged_index[0]
        fresh = self._staged[1:] if reuse else self._staged
        parts = [self._cached[1]] if reuse else []
        k = 0
        while k < len(fresh):  # runs of frames of one layout, size and matrix: one upload each
            j = k + 1
            while j < len(fresh) and _kind(fresh[j]) == _kind(fresh[k]):
                j += 1
            parts.append(self._convert(fresh[k:j]))
            k = j
        self.uploads += len(fresh)
        planes = tuple(torch.cat([p[c] for p in parts]) if len(parts) > 1 else parts[0][c] for c in range(3))
        self._cached = (self._staged_index[-1], tuple(p[-1:] for p in planes))
        return planes

    def _convert(self, frames: list[SourceFrame]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Frames of one kind -> (Y, U, V) float [k, h, w], [k, h/2, w/2] at the rect's size, in the
        frames' matrix: I420 is scaled plane by plane on the device (and re-matrixed if its matrix is not
        the frames'), RGB is converted."""
        if self.cuda and all(f.pinned is not None for f in frames):  # decoded into pinned memory: async copies
            t = torch.empty((len(frames), *frames[0].pixels.shape), dtype=torch.uint8, device=self.device)
            for i, f in enumerate(frames):
                t[i].copy_(f.pinned, non_blocking=True)
        else:
            host = torch.from_numpy(np.stack([f.pixels for f in frames]))
            if self.cuda:
                host = host.pin_memory()
            t = host.to(self.device, non_blocking=self.cuda)
        w, h = self.size
        if frames[0].layout == "rgb":
            yuv = rgb_to_yuv(t.permute(0, 3, 1, 2).float().div_(255), self.matrix)
            chroma = F.avg_pool2d(yuv[:, 1:], 2)
            return yuv[:, 0], chroma[:, 0], chroma[:, 1]
        sh = t.shape[1] * 2 // 3
        y, u, v = split_i420(t, sh, t.shape[2])
        def scale(p: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
            if tuple(p.shape[-2:]) == size:
                return p.float()
            return F.interpolate(p.float()[:, None], size=size, mode="bilinear", antialias=True,
                                 align_corners=False)[:, 0]

        y, u, v = scale(y, (h, w)), scale(u, (h // 2, w // 2)), scale(v, (h // 2, w // 2))
        if frames[0].matrix != self.matrix:  # via RGB, at full resolution
            up = lambda c: c.repeat_interleave(2, -2).repeat_interleave(2, -1)  # noqa: E731
            affine = torch.from_numpy(yuv_to_rgb_affine(frames[0].matrix)).float().to(self.device)
            rgb = torch.stack([y, up(u), up(v)], -1) @ affine[:, :3].T + affine[:, 3]
            yuv = rgb_to_yuv(rgb.clamp_(0, 255).div_(255).permute(0, 3, 1, 2), self.matrix)
            chroma = F.avg_pool2d(yuv[:, 1:], 2)
            y, u, v = yuv[:, 0], chroma[:, 0], chroma[:, 1]
        return y, u, v

    def paint(self, planes: Planes, lo: int, hi: int, opacity: torch.Tensor | None, aux: torch.Tensor) -> None:
        for bar in self.bars:
            bar.paint(planes, lo, hi, opacity, aux)
        ys, us, vs = self._src
        pick = aux.long()
        s = None if opacity is None else opacity.view(-1, 1, 1)
        x1, y1, x2, y2 = self.rect
        for plane, src, (a, b, c, d) in ((planes.y, ys, (x1, y1, x2, y2)),
                                         (planes.u, us, (x1 // 2, y1 // 2, x2 // 2, y2 // 2)),
                                         (planes.v, vs, (x1 // 2, y1 // 2, x2 // 2, y2 // 2))):
            region = plane[lo:hi, b:d, a:c]
            out = src[pick] if s is None else torch.lerp(region.float(), src[pick], s)  # lerp at 1: the source
            region.copy_(out.round_().clamp_(0, 255))

    def close(self) -> None:
        self.source.close()


def _kind(frame: SourceFrame) -> tuple:
    return frame.layout, frame.pixels.shape, frame.matrix


class Compositor:
    """The show's layers over a render's frames. Use `apply` on every batch, in order; `close` at the end
    (stops the video decoders).

    With `graphs` (on CUDA by default) a batch is painted whole by one CUDA graph per batch size: every
    layer over every frame, opacity 0 where it does not show (those frames come out untouched to the bit),
    so each batch is the same ~150 ops, replayed in one launch. They are launches from the render's
    producer thread, and each would take the GIL back from the writer's threads (loop.py). Without
    graphs (the CPU) each layer paints only the frames where it shows, in place."""

    def __init__(self, layers: list[Layer], frame_size: tuple[int, int], device: torch.device,
                 graphs: bool | None = None):
        self.layers = layers
        self.width, self.height = frame_size
        self.device = device
        self.graphs = device.type == "cuda" if graphs is None else graphs
        self._captured: dict[int, _Graph] = {}  # by batch size (a power of two, at least 8)

    def apply(self, frames: torch.Tensor, times: Sequence[FrameTime]) -> torch.Tensor:
        """Paint the layers into `frames` [B, H*3/2, W] uint8 I420 on the device: frame i is at `times[i]` =
        (scene index, seconds into that scene, seconds into the show). Without graphs in place (returned);
        with graphs the painted frames are returned in the graph's own buffer, valid until the next batch
        of that size (copy them out before)."""
        if frames.shape[0] != len(times):
            raise ValueError(f"{frames.shape[0]} frames and {len(times)} times")
        if not frames.is_contiguous():
            frames = frames.contiguous()
        plans = [layer.plan(times) for layer in self.layers]
        if all(p is None for p in plans):
            return frames
        if self.graphs:
            return self._replay(frames, plans)
        return self.apply_eager(frames, plans)

    def apply_eager(self, frames: torch.Tensor, plans: list) -> torch.Tensor:
        """Each layer over the frames it shows in, in place."""
        shown = [(k, p) for k, p in enumerate(plans) if p is not None]
        rows = torch.tensor([row for _, p in shown for row in p], dtype=torch.float32).to(self.device)
        planes = Planes.of(frames, self.height, self.width)
        for j, (k, (op, _)) in enumerate(shown):
            on = [i for i, o in enumerate(op) if o > 0]
            lo, hi = on[0], on[-1] + 1
            full = all(o == 1.0 for o in op[lo:hi])  # fully shown throughout: no fade to multiply in
            self.layers[k].stage()
            self.layers[k].paint(planes, lo, hi, None if full else rows[2 * j, lo:hi], rows[2 * j + 1, lo:hi])
        return frames

    def _replay(self, frames: torch.Tensor, plans: list) -> torch.Tensor:
        n = frames.shape[0]
        size = max(8, 1 << (n - 1).bit_length())
        if any([layer.reserve(size) for layer in self.layers if isinstance(layer, VideoLayer)]):
            self._captured.clear()  # their source buffers were made anew: capture again
        graph = self._captured.get(size)
        if graph is None:
            inputs = {"frames": torch.zeros((size, self.height * 3 // 2, self.width), dtype=torch.uint8,
                                            device=self.device),
                      "rows": torch.zeros((2 * len(self.layers), size), device=self.device)}
            try:
                graph = self._captured[size] = _Graph(self._paint_whole, inputs, self.device, None, warmups=1)
            except RuntimeError as e:  # not expected; the layers still paint, with a launch an op
                log.warning("the show's layers cannot be captured in a CUDA graph (%s); painting them without", e)
                self.graphs = False
                self._captured.clear()
                return self.apply_eager(frames, plans)
        for layer, p in zip(self.layers, plans):
            if p is not None:
                layer.stage()
        pad = [0.0] * (size - n)  # the rest of the graph's batch: opacity 0, painted over nothing of ours
        rows = torch.tensor([row + pad for p in plans for row in (p or ([0.0] * n, [0.0] * n))], dtype=torch.float32)
        graph.inputs["rows"].copy_(rows.pin_memory() if self.device.type == "cuda" else rows, non_blocking=True)
        graph.inputs["frames"][:n].copy_(frames)
        graph.replay()
        return graph.inputs["frames"][:n]

    def _paint_whole(self, frames: torch.Tensor, rows: torch.Tensor) -> None:
        """Every layer over every frame of the batch (what the graph captures)."""
        planes = Planes.of(frames, self.height, self.width)
        for k, layer in enumerate(self.layers):
            layer.paint(planes, 0, frames.shape[0], rows[2 * k], rows[2 * k + 1])

    def decoder_wait_s(self) -> float:
        """Seconds `apply` has waited for the video layers' decoders (the render loop's share of the show)."""
        return sum(layer.source.wait_s for layer in self.layers if isinstance(layer, VideoLayer))

    def close(self) -> None:
        self._captured.clear()  # the graphs' memory goes with them
        for layer in self.layers:
            layer.close()

    def __enter__(self) -> "Compositor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["Compositor", "FrameTime", "Layer", "Planes", "Rect", "SceneSpan", "Sprite", "SpriteLayer", "TickerLayer",
           "VideoLayer", "fade"]
