"""The SD VAE (sd-vae-ft-mse): the encoder for `compile` (face crops -> latents), the decoder for every frame.

Parameter names are those of `sd-vae/diffusion_pytorch_model.*` (diffusers' AutoencoderKL), so the
file loads key for key (models/checkpoint.py maps the old attention names it was saved with).

The decoder can decode only the face rows the blend uses (`row`): the blend mask is zero above
the nose tip, so the upper rows of every decoded face are thrown away, and the decoder's cost is in
its up blocks at 64-256 px (about 85% of its FLOPs). Those run from latent row `row` down; the mid
block (whose attention sees every position) and the first up block stay whole. Two things make it
approximate: the cut top edge is zero-padded instead of seeing the rows above, and each GroupNorm's
statistics span the whole map, cut rows included: `near` guesses them (models/blocks.py GroupNorm),
otherwise the rows decoded stand for the whole map. engine/decode.py says where it is measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lipstream.models.blocks import Attention, Downsample, GroupNorm, ResnetBlock, Upsample
from lipstream.models.config import check_keys

FIXED = {"act_fn": "silu", "down_block_types": ["DownEncoderBlock2D"], "up_block_types": ["UpDecoderBlock2D"],
         "mid_block_add_attention": True, "use_quant_conv": True, "use_post_quant_conv": True,
         "latents_mean": None, "latents_std": None, "shift_factor": None}
INFORMATIONAL = {"sample_size", "scaling_factor", "force_upcast", "in_channels", "out_channels", "latent_channels",
                 "block_out_channels", "layers_per_block", "norm_num_groups"}
EPS = 1e-6


@dataclass(frozen=True)
class VAEConfig:
    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 4
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    norm_num_groups: int = 32

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> VAEConfig:
        """From sd-vae/config.json; ValueError naming the first key this VAE does not implement."""
        check_keys(cfg, FIXED, INFORMATIONAL)
        return cls(cfg.get("in_channels", 3), cfg.get("out_channels", 3), cfg.get("latent_channels", 4),
                   tuple(cfg.get("block_out_channels", cls.block_out_channels)), cfg.get("layers_per_block", 2),
                   cfg.get("norm_num_groups", 32))


class MidBlock(nn.Module):
    """ResNet block, one-head self-attention over every position, ResNet block."""

    def __init__(self, channels: int, groups: int):
        super().__init__()
        first = ResnetBlock(channels, channels, groups, EPS, None)  # made in checkpoint order (seeded weights)
        self.attentions = nn.ModuleList([Attention(channels, 1, bias=True, groups=groups)])
        self.resnets = nn.ModuleList([first, ResnetBlock(channels, channels, groups, EPS, None)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resnets[1](self.attentions[0](self.resnets[0](x)))


class EncoderBlock(nn.Module):
    def __init__(self, channels: int, out: int, layers: int, groups: int, downsample: bool):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(channels if i == 0 else out, out, groups, EPS, None)
                                      for i in range(layers)])
        self.downsamplers = nn.ModuleList([Downsample(out, padding=0)]) if downsample else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return x if self.downsamplers is None else self.downsamplers[0](x)


class DecoderBlock(nn.Module):
    def __init__(self, channels: int, out: int, layers: int, groups: int, upsample: bool):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(channels if i == 0 else out, out, groups, EPS, None)
                                      for i in range(layers)])
        self.upsamplers = nn.ModuleList([Upsample(out)]) if upsample else None

    def forward(self, x: torch.Tensor, upsample: str, near: bool) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x, None, near)
        return x if self.upsamplers is None else self.upsamplers[0](x, upsample)


class Encoder(nn.Module):
    def __init__(self, c: VAEConfig):
        super().__init__()
        ch, g = c.block_out_channels, c.norm_num_groups
        self.conv_in = nn.Conv2d(c.in_channels, ch[0], 3, padding=1)
        self.down_blocks = nn.ModuleList([EncoderBlock(ch[max(i - 1, 0)], ch[i], c.layers_per_block, g,
                                                       i < len(ch) - 1) for i in range(len(ch))])
        self.mid_block = MidBlock(ch[-1], g)
        self.conv_norm_out = GroupNorm(g, ch[-1], eps=EPS)
        self.conv_out = nn.Conv2d(ch[-1], 2 * c.latent_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_in(x)
        for block in self.down_blocks:
            x = block(x)
        return self.conv_out(F.silu(self.conv_norm_out(self.mid_block(x))))


class Decoder(nn.Module):
    def __init__(self, c: VAEConfig):
        super().__init__()
        ch, g = c.block_out_channels[::-1], c.norm_num_groups
        self.conv_in = nn.Conv2d(c.latent_channels, ch[0], 3, padding=1)
        self.mid_block = MidBlock(ch[0], g)
        self.up_blocks = nn.ModuleList([DecoderBlock(ch[max(i - 1, 0)], ch[i], c.layers_per_block + 1, g,
                                                     i < len(ch) - 1) for i in range(len(ch))])
        self.conv_norm_out = GroupNorm(g, ch[-1], eps=EPS)
        self.conv_out = nn.Conv2d(ch[-1], c.out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor, upsample: str = "plain", row: int | None = None,
                near: bool = False) -> torch.Tensor:
        """[B, 4, h, w] (post-quant) latents -> [B, 3, 8h, 8w] in about [-1, 1]. With `row`, the face rows from
        latent row `row` down (the rows above come out as zeros), `near` guessing the cut rows' statistics."""
        x = self.up_blocks[0](self.mid_block(self.conv_in(z)), upsample, near)
        if row:
            x = x[:, :, row * (x.shape[-2] // z.shape[-2]):]
        for up in self.up_blocks[1:]:
            x = up(x, upsample, near)
        x = self.conv_out(F.silu(self.conv_norm_out(x, near)))
        return F.pad(x, (0, 0, x.shape[-1] - x.shape[-2], 0)) if row else x  # back to a square face


class VAE(nn.Module):
    """Images in [-1, 1] <-> latents (unscaled: callers apply 0.18215)."""

    def __init__(self, config: VAEConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.quant_conv = nn.Conv2d(2 * config.latent_channels, 2 * config.latent_channels, 1)
        self.post_quant_conv = nn.Conv2d(config.latent_channels, config.latent_channels, 1)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> [B, 4, H/8, W/8]: the mean of the latent distribution (its noise carries nothing)."""
        return self.quant_conv(self.encoder(x))[:, :self.config.latent_channels]

    def decode(self, z: torch.Tensor, upsample: str = "plain", row: int | None = None,
               near: bool = False) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(z), upsample, row, near)
