"""The benchmark's ablation engines and writers: the fast path with one optimisation taken out.

They exist for `lipstream bench`'s "fast -X" rows only, and are wired in by bench/run.py: the
product's engines and writer know nothing of them.
"""

from __future__ import annotations

import cv2
import numpy as np
import torch

from lipstream.avatar.colour import i420_to_rgb
from lipstream.engine.interface import FrameRequest
from lipstream.engine.reference import blend_reference
from lipstream.engine.engines import ModuleEngine
from lipstream.media.mp4 import MP4Writer


class CPUBlendEngine(ModuleEngine):
    """The fast network step, but blending done the old way: on the CPU with numpy, frame by frame
    ("GPU blending off"); the output matches ModuleEngine's."""

    @torch.inference_mode()
    def render(self, requests: list[FrameRequest]) -> torch.Tensor:
        for a in self.avatars:
            a.wait_frames()
        out = []
        for start in range(0, len(requests), self.batch_size):
            chunk = requests[start:start + self.batch_size]
            latents = torch.stack([self.avatars[r.avatar].latents[r.frame] for r in chunk])
            faces = self.faces(latents, torch.stack([r.window for r in chunk])).float().cpu().numpy()
            for r, face in zip(chunk, faces):
                a = self.avatars[r.avatar]
                w, h = a.size
                out.append(torch.from_numpy(blend_reference(
                    a.frames[r.frame].cpu().numpy(), face, a.masks[r.frame].cpu().numpy(),
                    self._boxes[r.avatar][r.frame], h, w, a.meta["colour_matrix"])))
        return torch.stack(out).to(self.device)


class RGBEngine(ModuleEngine):
    """The fast path with RGB frames out instead of I420 ("YUV path off"): blended in YUV on the device,
    then turned into RGB there, so the ablation measures an RGB hand-over (twice the bytes copied back,
    a colour conversion per frame on the CPU, by RGBToI420Writer)."""

    @torch.inference_mode()
    def render(self, requests: list[FrameRequest]) -> torch.Tensor:
        frames = super().render(requests)
        a = self.avatars[requests[0].avatar]
        w, h = a.size
        return i420_to_rgb(frames, h, w, a.meta["colour_matrix"])


class RGBToI420Writer(MP4Writer):
    """An MP4Writer fed RGB frames: the CPU converts each to I420 first (RGBEngine's other half)."""

    def write(self, planes: np.ndarray) -> None:
        super().write(cv2.cvtColor(planes, cv2.COLOR_RGB2YUV_I420))
