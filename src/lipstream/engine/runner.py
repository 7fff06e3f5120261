"""The engine: batches of frame requests -> blended full frames, on one device.

A request is (avatar slot, loop frame index, audio window). The engine does not care which
caller or scene a request comes from, so the offline renderer and the live server can both feed
it, and requests from several avatars share one batch (vLLM's split: whoever schedules decides
*what* runs; the engine only runs it).

On CUDA the whole network step (positional encoding, UNet, VAE decode, to [0, 1]) is captured
as a CUDA graph per batch-size bucket; a partial batch is padded up to its bucket, never run
eagerly. Optionally the VAE decoder (78% of the FLOPs) is compiled with Inductor first.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from lipstream.avatar import Avatar
from lipstream.engine.blend import blend_batch
from lipstream.models import MuseTalk
from lipstream.models.config import UNET_TIMESTEP, VAE_SCALING_FACTOR


@dataclass(frozen=True)
class FrameRequest:
    avatar: int  # slot returned by Engine.add_avatar
    frame: int  # index into that avatar's frames (after ping-pong)
    window: torch.Tensor  # [50, 384] audio window, no positional encoding yet


class _Graph:
    """One captured step at a fixed batch size: static inputs in, static output out."""

    def __init__(self, step: Callable, batch: int, device: torch.device, dtype: torch.dtype, pool):
        self.latents = torch.zeros(batch, 8, 32, 32, device=device, dtype=dtype)
        self.windows = torch.zeros(batch, 50, 384, device=device, dtype=dtype)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: cuBLAS/cuDNN handles and algorithm choices
                step(self.latents, self.windows)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = step(self.latents, self.windows)

    def __call__(self, latents: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        n = latents.shape[0]
        self.latents[:n].copy_(latents)
        self.windows[:n].copy_(windows)
        self.graph.replay()
        return self.out[:n]  # valid until the next replay of this graph


class Engine:
    """Renders frames with the fast path: fp16 on CUDA (fp32 on CPU), batched device-side blending."""

    def __init__(self, models: MuseTalk, batch_size: int = 16, *, graphs: bool | None = None,
                 compile_vae: bool = False, buckets: tuple[int, ...] | None = None):
        if models.unet is None or models.vae is None:
            raise ValueError("the engine needs the UNet and the VAE")
        self.m = models
        self.batch_size = batch_size
        self.avatars: list[Avatar] = []
        self._boxes: list[list[list[int]]] = []  # per avatar, on the CPU: blending never waits for the GPU
        self.use_graphs = (models.device.type == "cuda") if graphs is None else graphs
        self.buckets = tuple(sorted(buckets or (batch_size,)))
        self._graphs: dict[int, _Graph] = {}
        # A device tensor, as upstream passes it: a Python int would be copied from the CPU at every
        # step, which also breaks graph capture.
        self._timestep = torch.tensor([UNET_TIMESTEP], device=models.device)
        if compile_vae:
            cache = Path(os.environ.get("LIPSTREAM_CACHE", "~/.cache/lipstream")).expanduser() / "inductor"
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache))  # warm starts reuse compiled kernels
            self.m.vae.decoder = torch.compile(self.m.vae.decoder, dynamic=False)

    @property
    def device(self) -> torch.device:
        return self.m.device

    def add_avatar(self, avatar: Avatar) -> int:
        """Keep an avatar resident; returns its slot. Its tensors move to the engine's device."""
        if avatar.frames is None:
            raise ValueError(f"avatar {avatar.name} was loaded without its frames")
        self._boxes.append(avatar.boxes.cpu().tolist())
        for name in ("latents", "boxes", "masks", "frames"):
            setattr(avatar, name, getattr(avatar, name).to(self.device))
        avatar.latents = avatar.latents.to(self.m.dtype)
        self.avatars.append(avatar)
        return len(self.avatars) - 1

    def clear_avatars(self) -> None:
        """Drop every resident avatar (captured graphs do not depend on them and stay)."""
        self.avatars, self._boxes = [], []

    def _step(self, latents: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        audio = self.m.pe(windows)
        pred = self.m.unet(latents, self._timestep, encoder_hidden_states=audio).sample
        image = self.m.vae.decode(pred / VAE_SCALING_FACTOR).sample
        return (image.float() / 2 + 0.5).clamp_(0, 1)

    def warm_up(self) -> None:
        """Compile and capture every bucket now (startup), not on the first frames."""
        if self.use_graphs:
            for b in sorted(self.buckets, reverse=True):  # largest first: smaller ones reuse its memory
                self._graph(b)

    def _graph(self, bucket: int) -> _Graph:
        if bucket not in self._graphs:
            pool = next(iter(self._graphs.values())).graph.pool() if self._graphs else None
            with torch.inference_mode():
                self._graphs[bucket] = _Graph(self._step, bucket, self.device, self.m.dtype, pool)
        return self._graphs[bucket]

    @torch.inference_mode()
    def faces(self, latents: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """[B, 8, 32, 32] image latents + [B, 50, 384] windows -> [B, 3, 256, 256] RGB in [0, 1]."""
        latents = latents.to(self.device, self.m.dtype)
        windows = windows.to(self.device, self.m.dtype)
        if not self.use_graphs:
            return self._step(latents, windows)
        out = []
        for start in range(0, latents.shape[0], self.buckets[-1]):
            n = min(self.buckets[-1], latents.shape[0] - start)
            bucket = next(b for b in self.buckets if b >= n)
            out.append(self._graph(bucket)(latents[start:start + n], windows[start:start + n]))
        return out[0] if len(out) == 1 else torch.cat(out)

    @torch.inference_mode()
    def render(self, requests: list[FrameRequest]) -> torch.Tensor:
        """[B, H*3/2, W] uint8 I420 frames on the device, one per request, in order.

        All requests of one call must share a frame size (one output video).
        """
        out = []
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start:start + self.batch_size]
            latents = torch.stack([self.avatars[r.avatar].latents[r.frame] for r in chunk])
            windows = torch.stack([r.window for r in chunk])
            faces = self.faces(latents, windows)
            frames = torch.stack([self.avatars[r.avatar].frames[r.frame] for r in chunk])
            masks = torch.stack([self.avatars[r.avatar].masks[r.frame] for r in chunk])
            w, h = self.avatars[chunk[0].avatar].size
            by_matrix: dict[str, list[int]] = {}
            for i, r in enumerate(chunk):
                by_matrix.setdefault(self.avatars[r.avatar].meta["colour_matrix"], []).append(i)
            for matrix, idx in by_matrix.items():
                boxes = [self._boxes[chunk[i].avatar][chunk[i].frame] for i in idx]
                if len(idx) == len(chunk):
                    blend_batch(frames, faces, masks, boxes, h, w, matrix)
                else:
                    sub = frames[idx]
                    blend_batch(sub, faces[idx], masks[idx], boxes, h, w, matrix)
                    frames[idx] = sub
            out.append(frames)
        return out[0] if len(out) == 1 else torch.cat(out)
