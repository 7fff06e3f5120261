"""The engine: batches of frame requests -> blended full frames, on one device.

A request is (avatar slot, loop frame index, audio window). The engine does not care which
caller or scene a request comes from, so the offline renderer and the live server can both feed
it, and requests from several avatars share one batch (vLLM's split: whoever schedules decides
*what* runs; the engine only runs it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lipstream.avatar import Avatar
from lipstream.engine.blend import blend_into
from lipstream.models import MuseTalk
from lipstream.models.config import UNET_TIMESTEP, VAE_SCALING_FACTOR


@dataclass(frozen=True)
class FrameRequest:
    avatar: int  # slot returned by Engine.add_avatar
    frame: int  # index into that avatar's frames (after ping-pong)
    window: torch.Tensor  # [50, 384] audio window, no positional encoding yet


class Engine:
    """Renders frames with the fast path: fp16 on CUDA (fp32 on CPU), device-side blending."""

    def __init__(self, models: MuseTalk, batch_size: int = 16):
        if models.unet is None or models.vae is None:
            raise ValueError("the engine needs the UNet and the VAE")
        self.m = models
        self.batch_size = batch_size
        self.avatars: list[Avatar] = []

    @property
    def device(self) -> torch.device:
        return self.m.device

    def add_avatar(self, avatar: Avatar) -> int:
        """Keep an avatar resident; returns its slot. Its tensors move to the engine's device."""
        if avatar.frames is None:
            raise ValueError(f"avatar {avatar.name} was loaded without its frames")
        for name in ("latents", "boxes", "masks", "frames"):
            setattr(avatar, name, getattr(avatar, name).to(self.device))
        avatar.latents = avatar.latents.to(self.m.dtype)
        self.avatars.append(avatar)
        return len(self.avatars) - 1

    @torch.inference_mode()
    def faces(self, latents: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """[B, 8, 32, 32] image latents + [B, 50, 384] windows -> [B, 3, 256, 256] RGB in [0, 1]."""
        audio = self.m.pe(windows.to(self.device, self.m.dtype))
        pred = self.m.unet(latents.to(self.m.dtype), UNET_TIMESTEP, encoder_hidden_states=audio).sample
        image = self.m.vae.decode(pred / VAE_SCALING_FACTOR).sample
        return (image.float() / 2 + 0.5).clamp_(0, 1)

    @torch.inference_mode()
    def render(self, requests: list[FrameRequest]) -> torch.Tensor:
        """[B, H*3/2, W] uint8 I420 frames on the device, one per request, in order."""
        out = []
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start:start + self.batch_size]
            latents = torch.stack([self.avatars[r.avatar].latents[r.frame] for r in chunk])
            windows = torch.stack([r.window for r in chunk])
            faces = self.faces(latents, windows)
            for r, face in zip(chunk, faces):
                a = self.avatars[r.avatar]
                frame = a.frames[r.frame].clone()
                w, h = a.size
                blend_into(frame, face, a.masks[r.frame], a.boxes[r.frame].tolist(), h, w, a.meta["colour_matrix"])
                out.append(frame)
        return torch.stack(out)
