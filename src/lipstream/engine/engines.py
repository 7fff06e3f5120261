"""The engine: batches of frame requests -> blended full frames, on one device.

A request is (avatar, loop frame index, audio window). The engine does not care which
caller or scene a request comes from, so the offline renderer and the live server can both feed
it, and requests from several avatars share one batch (vLLM's split: whoever schedules decides
*what* runs; the engine only runs it).

On CUDA the network step (positional encoding, UNet, VAE decode, to [0, 1]) is captured as a
CUDA graph per batch-size bucket, and the blend as a second graph per bucket and frame size; a
partial batch is padded up to its bucket, never run eagerly. A batch costs the CPU a handful of
calls (gathers into the graphs' static inputs, two replays), which leaves the cores to the video
encoders. Optionally Inductor compiles the VAE decoder (78% of the FLOPs) or the whole step.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from lipstream.avatar import Avatar
from lipstream.engine.blend import blend_geometry, blend_static, canvas_size
from lipstream.engine.decode import check_mask_fits, mask_fits
from lipstream.engine.graphs import IndexRing, _Graph
from lipstream.engine.interface import FrameRequest
from lipstream.engine.step import NetStep
from lipstream.engine.surgery import cached_variant
from lipstream.models.blocks import fuse_upsamplers
from lipstream.models.config import WINDOW_STEPS, WINDOW_TOKENS
from lipstream.engine.options import EngineOptions

if TYPE_CHECKING:
    from lipstream.engine.aot import CompiledNetworks
    from lipstream.models import MuseTalk


log = logging.getLogger(__name__)
CANVAS_STEP = 32  # blend canvas sizes are rounded up to this: similar avatars share one blend graph
FAST_INDUCTOR = "all"  # what a compiled uncompiled-engine step means: the fastest mode measured on the H200

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # latents, windows -> faces


def net_steps(models: MuseTalk, upsample: str = "transpose", decode_row: int | None = EngineOptions.decode_row,
              decode_stats: str = "rows") -> dict[bool, NetStep]:
    """The network step with the whole decode (False) and, if `decode_row` is set, the cropped one (True).

    The steps share the networks' modules; the fused upsamplers' folded weights are buffers of the
    networks, made once per mode (models/blocks.py), so every engine and export on the same networks
    shares them too.
    """
    fuse_upsamplers(models.unet, upsample)
    fuse_upsamplers(models.vae.decoder, upsample)
    steps = {False: NetStep(models.pe, models.unet, models.vae, upsample).eval()}
    if decode_row is not None:
        steps[True] = NetStep(models.pe, models.unet, models.vae, upsample, decode_row, decode_stats == "near").eval()
    return steps


def _compiled(module: torch.nn.Module, mode: str | None) -> torch.nn.Module:
    """torch.compile once per module (engines on the same networks share its compiled code)."""
    return cached_variant(module, ("compiled", mode), lambda: torch.compile(module, dynamic=False, mode=mode))


class StepEngine:
    """What every fast engine shares: resident avatars, one blend canvas, CUDA graphs per bucket (the
    network step, then the blend into I420), `render` and `render_rows`. A subclass says where the
    network step comes from (`_step`): the networks' modules (ModuleEngine) or compiled packages (PackageEngine).

    Implements engine.interface.FrameEngine. `fixed_shapes`: the step's code is compiled for the bucket
    sizes only, so an uncaptured call is padded to one (no recompiles).
    """

    fixed_shapes = False
    graph_warmups = 1  # runs before capture (cuBLAS/cuDNN handles, algorithm choices; a compile: two)

    def __init__(self, device: torch.device, dtype: torch.dtype, options: EngineOptions, buckets: tuple[int, ...],
                 decode_row: int | None):
        options.check()
        self.o = options
        self.device, self.dtype = device, dtype
        self.avatars: list[Avatar] = []
        self._boxes: list[list[list[int]]] = []  # per avatar, on the CPU
        self._geometry: list[torch.Tensor] = []  # per avatar: [frames, 9] blend geometry on the device
        self.canvas: tuple[int, int] | None = None  # one blend canvas for every resident avatar
        self.use_graphs = (device.type == "cuda") if options.graphs is None else options.graphs
        self.buckets = tuple(sorted(set(buckets)))
        self.batch_size = self.buckets[-1]
        self._net: dict[tuple[int, bool], _Graph] = {}  # (bucket, cropped decode)
        self._blend: dict[tuple, _Graph] = {}
        self._pool = None
        # Frame indices go up through a ring of pinned buffers: a copy from pageable memory would
        # make the CPU wait for all the GPU work queued so far (no running ahead).
        self._staging = IndexRing(device, buffers=64)  # a live step makes a dozen uploads
        self.decode_rows = options.decode_rows
        self.decode_row = decode_row if options.decode_rows != "full" else None
        self._crop_ok: list[bool] = []  # per avatar: its masks fit the cropped decode

    def _step(self, latents: torch.Tensor, windows: torch.Tensor, cropped: bool) -> torch.Tensor:
        raise NotImplementedError

    def add_avatar(self, avatar: Avatar) -> int:
        """Keep an avatar resident; returns its index (FrameRequest.avatar). Its tensors move to the device."""
        if avatar.frames is None:
            raise ValueError(f"avatar {avatar.name} was loaded without its frames")
        fits = self.decode_row is not None and mask_fits(avatar.masks, self.decode_row)
        if self.decode_rows == "mask" and not fits:
            check_mask_fits(avatar.masks, self.decode_row, avatar.path)
        self._crop_ok.append(fits)
        self._boxes.append(avatar.boxes.cpu().tolist())
        for name in ("latents", "boxes", "masks"):
            setattr(avatar, name, getattr(avatar, name).to(self.device))
        if avatar.frames.device.type != self.device.type:
            avatar.wait_frames()
            avatar.frames = avatar.frames.to(self.device)
        avatar.latents = avatar.latents.to(self.dtype)
        self.avatars.append(avatar)
        self._fit_canvas()
        return len(self.avatars) - 1

    def clear_avatars(self) -> None:
        """Drop every resident avatar (captured graphs do not depend on them and stay)."""
        self.avatars, self._boxes, self._geometry, self.canvas, self._crop_ok = [], [], [], None, []

    def _fit_canvas(self) -> None:
        """One blend canvas that covers every box of every resident avatar (a static graph shape)."""
        sizes = [canvas_size(boxes, a.size[1], a.size[0]) for a, boxes in zip(self.avatars, self._boxes)]
        up = lambda v: -(-v // CANVAS_STEP) * CANVAS_STEP  # noqa: E731  (fewer distinct graph shapes)
        self.canvas = (up(max(s[0] for s in sizes)), up(max(s[1] for s in sizes)))
        self._geometry = []
        for a, boxes in zip(self.avatars, self._boxes):
            w, h = a.size
            canvas = (min(h, self.canvas[0]), min(w, self.canvas[1]))
            self._geometry.append(blend_geometry(boxes, h, w, canvas, a.meta["colour_matrix"]).to(self.device))

    def _cropped(self, avatars: list[int] | None) -> bool:
        """Whether a batch of these avatars (all resident ones if None) takes the cropped decode."""
        if self.decode_row is None:
            return False
        return all(self._crop_ok[a] for a in avatars) if avatars else self.decode_rows == "mask" or all(self._crop_ok)

    def _eager_step(self, latents: torch.Tensor, windows: torch.Tensor, cropped: bool) -> torch.Tensor:
        """The step without graphs; compiled code still sees only bucket shapes (no recompiles)."""
        n = latents.shape[0]
        if not self.fixed_shapes or n in self.buckets:
            return self._step(latents, windows, cropped)
        bucket = next((b for b in self.buckets if b >= n), n)
        pad = lambda t: torch.cat([t, t.new_zeros(bucket - n, *t.shape[1:])])  # noqa: E731
        return self._step(pad(latents), pad(windows), cropped)[:n]

    def warm_up(self, buckets: tuple[int, ...] | None = None) -> dict[str, float]:
        """Compile and capture these buckets (None: every one) now, not on the first frames that need
        them; the seconds each bucket's step and blend took (none for what was captured before)."""
        seconds: dict[str, float] = {}
        for _, name, capture in self._missing(buckets):
            t = time.perf_counter()
            capture()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t
        return seconds

    def uncaptured(self) -> tuple[int, ...]:
        """The buckets with a graph warm_up() would still capture for the resident avatars."""
        return tuple(sorted({b for b, _, _ in self._missing(None)}))

    def _missing(self, buckets: tuple[int, ...] | None) -> list[tuple[int, str, Callable[[], object]]]:
        """(bucket, name, capture) of each graph of these buckets not captured yet, largest bucket first
        (smaller ones reuse its memory): a step before its blends."""
        if not self.use_graphs:
            return []
        kinds = {self._cropped([a]) for a in range(len(self.avatars))} or {self._cropped(None)}
        wanted = self.buckets if buckets is None else [b for b in self.buckets if b in buckets]
        missing = []
        for b in sorted(wanted, reverse=True):
            for cropped in kinds:
                if (b, cropped) not in self._net:
                    missing.append((b, f"step {b}", functools.partial(self._net_graph, b, cropped)))
                missing += [(b, f"blend {b}", functools.partial(self._blend_graph, b, *a.size, cropped))
                            for a in self.avatars if self._blend_key(b, *a.size, cropped) not in self._blend]
        return missing

    def _net_graph(self, bucket: int, cropped: bool | None = None) -> _Graph:
        key = (bucket, self._cropped(None) if cropped is None else cropped)
        if key not in self._net:
            inputs = {"latents": torch.zeros(bucket, 8, 32, 32, device=self.device, dtype=self.dtype),
                      "windows": torch.zeros(bucket, 50, 384, device=self.device, dtype=self.dtype)}
            step = functools.partial(self._step, cropped=key[1])
            with torch.inference_mode():
                self._net[key] = _Graph(step, inputs, self.device, self._pool, self.graph_warmups)
            self._pool = self._pool or self._net[key].graph.pool()
        return self._net[key]

    def _blend_key(self, bucket: int, width: int, height: int, cropped: bool, own_faces: bool = False) -> tuple:
        canvas = (min(height, self.canvas[0]), min(width, self.canvas[1]))
        return bucket, width, height, canvas, cropped, own_faces

    def _blend_graph(self, bucket: int, width: int, height: int, cropped: bool, own_faces: bool = False) -> _Graph:
        """The blend of a bucket into frames of one size; `own_faces`: it reads a static `faces` input
        (a subset of a mixed-size step's faces) instead of the network graph's output."""
        key = self._blend_key(bucket, width, height, cropped, own_faces)
        canvas = key[3]
        if key not in self._blend:
            faces = self._net_graph(bucket, cropped).out
            if own_faces:
                faces = torch.zeros_like(faces)
            geometry = torch.tensor([[0, 0, 0, 0, canvas[1], canvas[0], 0.299, 0.587, 0.114]],
                                    device=self.device).repeat(bucket, 1)  # padding rows: a valid box
            inputs = {"frames": torch.zeros(bucket, height * 3 // 2, width, dtype=torch.uint8, device=self.device),
                      "masks": torch.zeros(bucket, *faces.shape[-2:], dtype=torch.uint8, device=self.device),
                      "geometry": geometry}
            if own_faces:
                inputs["faces"] = faces

            def blend(frames: torch.Tensor, masks: torch.Tensor, geometry: torch.Tensor,
                      faces: torch.Tensor = faces) -> None:
                blend_static(frames, faces, masks, geometry, height, width, canvas)

            with torch.inference_mode():
                self._blend[key] = _Graph(blend, inputs, self.device, self._pool, warmups=1)
        return self._blend[key]

    @torch.inference_mode()
    def faces(self, latents: torch.Tensor, windows: torch.Tensor, avatars: list[int] | None = None) -> torch.Tensor:
        """[B, 8, 32, 32] image latents + [B, 50, 384] windows -> [B, 3, 256, 256] RGB in [0, 1].

        `avatars`: the ones the latents come from (they decide a cropped decode); None: all resident ones.
        """
        latents = latents.to(self.device, self.dtype)
        windows = windows.to(self.device, self.dtype)
        cropped = self._cropped(avatars)
        if not self.use_graphs:
            return self._eager_step(latents, windows, cropped)
        out = []
        for start in range(0, latents.shape[0], self.buckets[-1]):
            n = min(self.buckets[-1], latents.shape[0] - start)
            graph = self._net_graph(next(b for b in self.buckets if b >= n), cropped)
            graph.inputs["latents"][:n].copy_(latents[start:start + n])
            graph.inputs["windows"][:n].copy_(windows[start:start + n])
            out.append(graph.replay()[:n].clone())
        return out[0] if len(out) == 1 else torch.cat(out)

    def prefetch(self, requests: list[FrameRequest]) -> None:
        """Nothing to start early: `render` queues its GPU work and returns at once."""

    @torch.inference_mode()
    def render(self, requests: list[FrameRequest]) -> torch.Tensor:
        """[B, H*3/2, W] uint8 I420 frames on the device, one per request, in order.

        All requests of one call must share a frame size (one output video). With graphs, a call
        of at most `buckets[-1]` requests returns a view of the blend graph's output: valid until
        that bucket runs again (copy it out before the next call).
        """
        step = self.buckets[-1]
        if len(requests) <= step:
            return self._render_chunk(requests)
        # Each chunk's frames live in its blend graph's buffer, which the next chunk of the same
        # bucket overwrites: copy them out first.
        return torch.cat([self._render_chunk(requests[s:s + step]).clone() for s in range(0, len(requests), step)])

    def _render_chunk(self, chunk: list[FrameRequest]) -> torch.Tensor:
        n = len(chunk)
        w, h = self.avatars[chunk[0].avatar].size
        bucket = next(b for b in self.buckets if b >= n)
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(chunk):
            groups.setdefault(r.avatar, []).append(i)
        windows = torch.stack([r.window for r in chunk])
        cropped = self._cropped(list(groups))
        # capture "later": a bucket not captured yet runs uncaptured (warm_up captures it, in the render loop)
        graphs = self.use_graphs and (self.o.capture != "later" or (
            (bucket, cropped) in self._net and self._blend_key(bucket, w, h, cropped) in self._blend))
        if graphs:
            net, blend = self._net_graph(bucket, cropped), self._blend_graph(bucket, w, h, cropped)
            latents, frames = net.inputs["latents"], blend.inputs["frames"]
            masks, geometry = blend.inputs["masks"], blend.inputs["geometry"]
            net.inputs["windows"][:n].copy_(windows)
        else:
            latents = torch.empty(n, 8, 32, 32, device=self.device, dtype=self.dtype)
            frames = torch.empty(n, h * 3 // 2, w, dtype=torch.uint8, device=self.device)
            masks = torch.empty(n, *self.avatars[chunk[0].avatar].masks.shape[-2:], dtype=torch.uint8,
                                device=self.device)
            geometry = torch.empty(n, 9, device=self.device)
        for avatar, where in groups.items():
            a = self.avatars[avatar]
            wanted = [chunk[i].frame for i in where]
            a.wait_frames(max(wanted) + 1)  # a no-op once the avatar's frames are all resident
            index = self._staging.upload(wanted)
            targets = [(latents, a.latents), (frames, a.frames), (masks, a.masks), (geometry, self._geometry[avatar])]
            if len(where) == n:  # one avatar: straight gathers into the static inputs
                for dst, src in targets:
                    torch.index_select(src, 0, index, out=dst[:n])
            else:
                at = self._staging.upload(where)
                for dst, src in targets:
                    dst.index_copy_(0, at, src.index_select(0, index))
        if not graphs:
            faces = self._eager_step(latents, windows.to(self.device, self.dtype), cropped)
            blend_static(frames, faces, masks, geometry, h, w, (min(h, self.canvas[0]), min(w, self.canvas[1])))
            return frames
        net.replay()
        blend.replay()
        return frames[:n]

    @torch.inference_mode()
    def render_rows(self, avatars: list[int], frames: list[int], table: torch.Tensor, rows: list[int],
                    windows: torch.Tensor | None = None) -> list[tuple[list[int], torch.Tensor]]:
        """One step over frames of any resident avatars, of any frame sizes (the live scheduler's call).

        Frame i shows loop frame `frames[i]` of avatar `avatars[i]`. The audio windows of the first
        len(rows) // 10 frames are rows of `table` ([R, 5, 384] features on the device, 10 rows a
        frame): one gather on the device, no window tensor built per frame. `windows` [k, 50, 384]
        serve the k frames after those. Returns, per frame size, the positions of its frames and
        their I420 frames on the device: with graphs, views into graph buffers that the next call
        overwrites (copy them out first).
        """
        n = len(avatars)
        live = len(rows) // WINDOW_STEPS
        if n == 0 or n > self.buckets[-1] or live + (0 if windows is None else len(windows)) != n:
            raise ValueError(f"a step takes 1 to {self.buckets[-1]} frames, each with one window")
        bucket = next(b for b in self.buckets if b >= n)
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(avatars):
            groups.setdefault(s, []).append(i)
        cropped = self._cropped(list(groups))
        if self.use_graphs:
            net = self._net_graph(bucket, cropped)
            latents, win = net.inputs["latents"], net.inputs["windows"]
        else:
            latents = torch.empty(n, 8, 32, 32, device=self.device, dtype=self.dtype)
            win = torch.empty(n, WINDOW_TOKENS, table.shape[-1], device=self.device, dtype=self.dtype)
        if live:
            index = self._staging.upload(rows)
            torch.index_select(table, 0, index, out=win[:live].view(len(rows), *table.shape[1:]))
        if windows is not None and len(windows):
            win[live:n].copy_(windows)
        self._gather(groups, n, [(latents, lambda a, s: a.latents)], frames)
        faces = net.replay() if self.use_graphs else self._eager_step(latents, win, cropped)
        sizes: dict[tuple[int, int], list[int]] = {}
        for i, s in enumerate(avatars):
            sizes.setdefault(self.avatars[s].size, []).append(i)
        out = []
        for (w, h), where in sizes.items():
            k = len(where)
            canvas = (min(h, self.canvas[0]), min(w, self.canvas[1]))
            sub = {s: [j for j, i in enumerate(where) if avatars[i] == s] for s in {avatars[i] for i in where}}
            sub_frames = [frames[i] for i in where]
            if self.use_graphs:
                whole = len(sizes) == 1
                blend = self._blend_graph(bucket if whole else next(b for b in self.buckets if b >= k),
                                          w, h, cropped, own_faces=not whole)
                if not whole:
                    torch.index_select(faces, 0, self._staging.upload(where), out=blend.inputs["faces"][:k])
                dst = blend.inputs
            else:
                dst = {"frames": torch.empty(k, h * 3 // 2, w, dtype=torch.uint8, device=self.device),
                       "masks": torch.empty(k, *self.avatars[avatars[where[0]]].masks.shape[-2:], dtype=torch.uint8,
                                            device=self.device),
                       "geometry": torch.empty(k, 9, device=self.device)}
            self._gather(sub, k, [(dst["frames"], lambda a, s: a.frames), (dst["masks"], lambda a, s: a.masks),
                                  (dst["geometry"], lambda a, s: self._geometry[s])], sub_frames)
            if self.use_graphs:
                blend.replay()
            else:
                blend_static(dst["frames"], faces[where] if len(sizes) > 1 else faces, dst["masks"], dst["geometry"],
                             h, w, canvas)
            out.append((where, dst["frames"][:k]))
        return out

    def _gather(self, groups: dict[int, list[int]], n: int, targets: list, frames: list[int]) -> None:
        """Fill rows [0, n) of each target with its avatar tensor's rows for these loop frames."""
        for avatar, where in groups.items():
            a = self.avatars[avatar]
            wanted = [frames[i] for i in where]
            a.wait_frames(max(wanted) + 1)
            index = self._staging.upload(wanted)
            if len(where) == n:
                for dst, src in targets:
                    torch.index_select(src(a, avatar), 0, index, out=dst[:n])
            else:
                at = self._staging.upload(where)
                for dst, src in targets:
                    dst.index_copy_(0, at, src(a, avatar).index_select(0, index))


class ModuleEngine(StepEngine):
    """The fast engine on the networks' modules: fp16 on CUDA (fp32 on CPU), fused upsamplers, the
    cropped decode where the avatars allow it, optionally Inductor (`options.inductor`) on the buckets
    in `compile_buckets` (each a compile of minutes on a cold cache; the others run the same modules
    uncompiled). `buckets` (default: options.buckets) are the batch sizes captured."""

    def __init__(self, models: MuseTalk, options: EngineOptions | None = None, *,
                 buckets: tuple[int, ...] | None = None, compile_buckets: tuple[int, ...] | None = None):
        if models.unet is None or models.vae is None:
            raise ValueError("the engine needs the UNet and the VAE")
        options = (options or EngineOptions()).for_device(models.device.type)
        super().__init__(models.device, models.dtype, options, buckets or options.buckets, options.decode_row)
        self.m = models
        self.inductor = options.inductor
        self.fixed_shapes = self.inductor != "off"
        self.graph_warmups = 2 if self.fixed_shapes else 1  # torch.compile compiles in the first run
        self._steps = net_steps(models, options.upsample, self.decode_row, options.decode_stats)
        self.compile_buckets = compile_buckets if self.inductor != "off" else None
        self._plain = self._steps
        if self.compile_buckets is not None:
            self._plain = net_steps(models, options.upsample, self.decode_row, options.decode_stats)
        if self.inductor != "off":
            from lipstream.engine.aot import cache_root

            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))  # warm starts reuse compiled kernels
            # Modules, not the step: a compiled module's code is shared by every ModuleEngine with the same
            # shapes (parameters are graph inputs), so a second engine in a process reuses it.
            for step in self._steps.values():
                step.decoder = _compiled(step.decoder, None)
                if self.inductor == "all":
                    step.unet = _compiled(step.unet, None)

    def _step(self, latents: torch.Tensor, windows: torch.Tensor, cropped: bool = False) -> torch.Tensor:
        plain = self.compile_buckets is not None and latents.shape[0] not in self.compile_buckets
        return (self._plain if plain else self._steps)[cropped](latents, windows)


class PackageEngine(StepEngine):
    """The fast engine on ahead-of-time compiled packages (engine/aot.py): no network modules built,
    no compile wait. Its maths options (upsample, decode row and statistics) are the packages' own."""

    fixed_shapes = True

    def __init__(self, compiled: CompiledNetworks, options: EngineOptions | None = None, *,
                 buckets: tuple[int, ...] | None = None):
        options = (options or EngineOptions()).for_device(compiled.device.type)
        if options.inductor != "off":
            raise ValueError("an engine on compiled packages takes no inductor option")
        super().__init__(compiled.device, compiled.dtype, options, buckets or options.buckets,
                         compiled.options.decode_row)
        self.compiled = compiled
        self._steps: dict[bool, Step] = dict(compiled.steps)
        if self.decode_row is not None and True not in self._steps:
            raise ValueError("these compiled packages have no cropped decode: use decode_rows='full'")

    def _step(self, latents: torch.Tensor, windows: torch.Tensor, cropped: bool = False) -> torch.Tensor:
        return self._steps[cropped](latents, windows)

    def warm_up(self, buckets: tuple[int, ...] | None = None) -> dict[str, float]:
        try:
            return super().warm_up(buckets)
        except RuntimeError as e:
            # A compiled package whose calls cannot be captured still runs, only with more CPU work.
            log.warning("the compiled step cannot be captured in a CUDA graph (%s); running it without graphs", e)
            torch.cuda.synchronize(self.device)
            self.use_graphs, self._net, self._blend, self._pool = False, {}, {}, None
            return {}
