"""Face crops (256x256 RGB) and their VAE latents: the UNet's image input, computed once per avatar.

As upstream (musetalk/models/vae.py, get_latents_for_unet): the crop in [-1, 1], once with its
lower half blacked out and once whole, each encoded by the SD VAE and scaled by 0.18215, then
concatenated to [8, 32, 32]. We take the mean of the latent distribution where upstream draws a
sample: the cache is then deterministic, and the sample's noise (std ~exp(logvar/2), small for
this VAE) carries no information.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import cv2
import numpy as np
import torch

from lipstream.media.pixels import yuv_to_rgb_affine
from lipstream.models.config import CROP_SIZE, VAE_SCALING_FACTOR

if TYPE_CHECKING:
    from lipstream.models.vae import VAE


def face_crop(frame: np.ndarray, box: np.ndarray, width: int, height: int, matrix: str,
              size: int = CROP_SIZE) -> np.ndarray:
    """The box of one I420 frame as [size, size, 3] uint8 RGB (Lanczos, as upstream's cv2 resize).

    Only the box is converted to RGB (chroma replicated 2x2, one SIMD affine per pixel); OpenCV
    releases the GIL, so frames convert in parallel threads.
    """
    x1, y1, x2, y2 = (int(v) for v in box)
    ex1, ey1 = x1 & ~1, y1 & ~1  # chroma is subsampled 2x2: convert an even-aligned region
    ex2, ey2 = min(width, (x2 + 1) & ~1), min(height, (y2 + 1) & ~1)
    y = frame[ey1:ey2, ex1:ex2]
    quarter = (height // 2) * (width // 2)
    chroma = frame[height:].reshape(-1)
    u = chroma[:quarter].reshape(height // 2, width // 2)[ey1 // 2:ey2 // 2, ex1 // 2:ex2 // 2]
    v = chroma[quarter:].reshape(height // 2, width // 2)[ey1 // 2:ey2 // 2, ex1 // 2:ex2 // 2]
    full = (y.shape[1], y.shape[0])
    yuv = cv2.merge([y, cv2.resize(u, full, interpolation=cv2.INTER_NEAREST),
                     cv2.resize(v, full, interpolation=cv2.INTER_NEAREST)])
    rgb = cv2.transform(yuv, yuv_to_rgb_affine(matrix))  # rounds and saturates to uint8
    region = rgb[y1 - ey1:y2 - ey1, x1 - ex1:x2 - ex1]
    return cv2.resize(region, (size, size), interpolation=cv2.INTER_LANCZOS4)


def to_vae_input(crops: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 256, 256, 3] uint8 -> (masked, reference) [B, 3, 256, 256] in [-1, 1]."""
    x = crops.permute(0, 3, 1, 2).to(dtype) / 255.0
    masked = x.clone()
    masked[:, :, x.shape[2] // 2:, :] = 0  # upstream zeroes the lower half before normalising
    return masked * 2 - 1, x * 2 - 1


@torch.inference_mode()
def encode_latents(crops: np.ndarray | torch.Tensor, vae: VAE, batch: int = 32) -> torch.Tensor:
    """[N, 256, 256, 3] uint8 RGB crops -> [N, 8, 32, 32] UNet image input on the VAE's device/dtype."""
    param = next(vae.parameters())
    crops = torch.as_tensor(crops)
    out = []
    for start in range(0, crops.shape[0], batch):
        chunk = crops[start:start + batch].to(param.device, non_blocking=True)
        masked, reference = to_vae_input(chunk, param.dtype)
        both = vae.encode(torch.cat([masked, reference])) * VAE_SCALING_FACTOR
        n = chunk.shape[0]
        out.append(torch.cat([both[:n], both[n:]], dim=1))
    return torch.cat(out)


def warm_vae_encoder(vae: VAE, batch: int = 32) -> None:
    """One batch of blank crops through the encoder (on a thread while the crops are cut): a process's first
    batch on a GPU pays for its kernels' loading and cuDNN's choices."""
    encode_latents(np.zeros((batch, CROP_SIZE, CROP_SIZE, 3), np.uint8), vae, batch)
    param = next(vae.parameters())
    if param.device.type == "cuda":
        torch.cuda.current_stream(param.device).synchronize()
