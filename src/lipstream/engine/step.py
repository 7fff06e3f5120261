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

    `decoder` is the VAE decoder or a CroppedDecoder around it; the modules are shared, not copied.
    """

    def __init__(self, pe: nn.Module, unet: nn.Module, post_quant_conv: nn.Module | None, decoder: nn.Module):
        super().__init__()
        self.pe, self.unet, self.post_quant_conv, self.decoder = pe, unet, post_quant_conv, decoder
        # A device tensor, as upstream passes it: a Python int would be copied from the CPU at every
        # step, which also breaks graph capture.
        device = next(unet.parameters()).device
        self.register_buffer("timestep", torch.tensor([UNET_TIMESTEP], device=device), persistent=False)

    def forward(self, latents: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        audio = self.pe(windows)
        pred = self.unet(latents, self.timestep, encoder_hidden_states=audio).sample
        z = pred / VAE_SCALING_FACTOR
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        image = self.decoder(z)
        return (image.float() / 2 + 0.5).clamp(0, 1)


class WhisperStep(nn.Module):
    """[S, 80, 3000] log-mel -> [S, 1500, 5, 384]: every hidden state of the Whisper encoder, stacked."""

    def __init__(self, encoder: nn.Module):
        super().__init__()
        self.encoder = encoder

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.encoder(mel, output_hidden_states=True).hidden_states, dim=2)
