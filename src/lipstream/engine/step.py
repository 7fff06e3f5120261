"""The network step as one module: audio windows + image latents -> face crops in [0, 1].

One module (not a method of the engine) so that the same thing is run eagerly, captured in a
CUDA graph, torch.compile'd, or exported and compiled ahead of time (engine/aot.py).
"""

from __future__ import annotations

import torch
from torch import nn

from lipstream.models.config import UNET_TIMESTEP, VAE_SCALING_FACTOR


class NetStep(nn.Module):
    """Positional encoding -> UNet (one step, timestep 0) -> VAE decode -> [B, 3, 256, 256] float32 in [0, 1].

    The networks are shared, not copied. `upsample`: "plain" or a mode their upsamplers were fused for
    (models/blocks.py); `decode_row`: decode the face rows from that latent row down, `near` guessing the
    cut rows' GroupNorm statistics (models/vae.py).
    """

    def __init__(self, pe: nn.Module, unet: nn.Module, vae: nn.Module, upsample: str = "plain",
                 decode_row: int | None = None, near: bool = False):
        super().__init__()
        self.pe, self.unet, self.post_quant_conv, self.decoder = pe, unet, vae.post_quant_conv, vae.decoder
        self.upsample, self.decode_row, self.near = upsample, decode_row, near

    def forward(self, latents: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        pred = self.unet(latents, self.pe(windows), UNET_TIMESTEP, self.upsample)
        z = self.post_quant_conv(pred / VAE_SCALING_FACTOR)
        image = self.decoder(z, self.upsample, self.decode_row, self.near)
        return (image.float() / 2 + 0.5).clamp(0, 1)
