"""The reference path (`--reference`): plain eager fp32 inference and numpy/OpenCV blending.

Slow and obvious on purpose: the fast engine must match it (PSNR on the face boxes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import cv2
import numpy as np
import torch

from lipstream.media.pixels import MATRICES
from lipstream.engine.blend import chroma_span
from lipstream.engine.interface import FrameRequest
from lipstream.engine.engines import ModuleEngine
from lipstream.engine.options import ENGINE_PRESETS

if TYPE_CHECKING:
    from lipstream.models import MuseTalk



def blend_reference(frame: np.ndarray, face: np.ndarray, mask: np.ndarray, box, height: int, width: int,
                    matrix: str) -> np.ndarray:
    """numpy float64 version of blend.blend_into; returns a new frame."""
    out = frame.copy()
    x1, y1, x2, y2 = (int(v) for v in box)
    h, w = y2 - y1, x2 - x1
    rgb = cv2.resize(face.transpose(1, 2, 0).astype(np.float32), (w, h), interpolation=cv2.INTER_LINEAR)
    alpha = cv2.resize(mask.astype(np.float32) / 255.0, (w, h), interpolation=cv2.INTER_LINEAR).astype(np.float64)
    r, g, b = (np.clip(rgb[..., i].astype(np.float64), 0, 1) for i in range(3))
    kr, kb = MATRICES[matrix]
    yl = kr * r + (1 - kr - kb) * g + kb * b
    yuv = [16 + 219 * yl, 128 + 224 * (b - yl) / (2 * (1 - kb)), 128 + 224 * (r - yl) / (2 * (1 - kr))]
    luma = out[:height]
    luma[y1:y2, x1:x2] = np.clip(np.round(luma[y1:y2, x1:x2] * (1 - alpha) + yuv[0] * alpha), 0, 255)
    cx1, cx2 = chroma_span(x1, x2)
    cy1, cy2 = chroma_span(y1, y2)
    if cx2 > cx1 and cy2 > cy1:
        ox, oy = 2 * cx1 - x1, 2 * cy1 - y1
        sl = (slice(oy, oy + 2 * (cy2 - cy1)), slice(ox, ox + 2 * (cx2 - cx1)))
        pool = lambda a: a.reshape(a.shape[0] // 2, 2, a.shape[1] // 2, 2).mean(axis=(1, 3))  # noqa: E731
        a_c = pool(alpha[sl])
        quarter = (height // 2) * (width // 2)
        chroma = out[height:].reshape(-1)
        for k, values in ((0, yuv[1]), (1, yuv[2])):
            plane = chroma[k * quarter:(k + 1) * quarter].reshape(height // 2, width // 2)
            target = plane[cy1:cy2, cx1:cx2]
            plane[cy1:cy2, cx1:cx2] = np.clip(np.round(target * (1 - a_c) + pool(alpha[sl] * values[sl])), 0, 255)
    return out


class ReferenceEngine(ModuleEngine):
    """Same requests, same outputs, computed the plain way: fp32 eager networks, numpy blend per frame.

    The networks see small batches (the maths per frame is the same; one frame at a time made the
    benchmark's reference renders take minutes of GPU time).
    """

    def __init__(self, models: MuseTalk, batch_size: int = 16):
        if models.dtype != torch.float32:
            raise ValueError("the reference path runs in fp32")
        # The exact maths whatever the fast defaults are: whole decode, plain upsamplers.
        super().__init__(models, ENGINE_PRESETS["reference"].replace(batch=batch_size), buckets=(batch_size,))

    @torch.inference_mode()
    def render(self, requests: list[FrameRequest]) -> torch.Tensor:
        for a in self.avatars:
            a.wait_frames()
        latents = torch.stack([self.avatars[r.avatar].latents[r.frame] for r in requests]).float()
        faces = self.faces(latents, torch.stack([r.window for r in requests]).float()).cpu().numpy()
        out = []
        for r, face in zip(requests, faces):
            a = self.avatars[r.avatar]
            w, h = a.size
            frame = blend_reference(a.frames[r.frame].cpu().numpy(), face, a.masks[r.frame].cpu().numpy(),
                                    a.boxes[r.frame].tolist(), h, w, a.meta["colour_matrix"])
            out.append(torch.from_numpy(frame))
        return torch.stack(out).to(self.device)
