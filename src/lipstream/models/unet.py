"""MuseTalk v1.5's UNet: the SD-1.x UNet layout with 8 input and 4 output channels, run once at timestep 0.

Only what MuseTalk's configuration uses: cross-attention down and up blocks (a ResNet block and a
transformer block per layer), plain down and up blocks, the cross-attention mid block, 1x1-conv
projections into the transformer blocks (self-attention, cross-attention over the 50 audio tokens,
a GEGLU feed-forward), and the sinusoidal timestep embedding. Parameter names are those of
`musetalkV15/unet.pth` (diffusers' UNet2DConditionModel), so the file loads key for key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lipstream.models.blocks import Attention, Downsample, GroupNorm, ResnetBlock, Upsample
from lipstream.models.config import check_keys

DOWN_BLOCKS = ("CrossAttnDownBlock2D", "DownBlock2D")
UP_BLOCKS = ("CrossAttnUpBlock2D", "UpBlock2D")
# Keys a config may hold only with these values: what this UNet implements (diffusers' defaults).
FIXED = {"act_fn": "silu", "center_input_sample": False, "mid_block_type": "UNetMidBlock2DCrossAttn",
         "use_linear_projection": False, "only_cross_attention": False, "upcast_attention": False,
         "resnet_time_scale_shift": "default", "dual_cross_attention": False, "class_embed_type": None,
         "addition_embed_type": None, "encoder_hid_dim": None, "encoder_hid_dim_type": None,
         "time_embedding_type": "positional", "time_embedding_dim": None, "time_embedding_act_fn": None,
         "timestep_post_act": None, "time_cond_proj_dim": None, "conv_in_kernel": 3, "conv_out_kernel": 3,
         "num_attention_heads": None, "transformer_layers_per_block": 1, "num_class_embeds": None,
         "projection_class_embeddings_input_dim": None, "class_embeddings_concat": False,
         "mid_block_only_cross_attention": None, "cross_attention_norm": None, "addition_time_embed_dim": None,
         "reverse_transformer_layers_per_block": None, "resnet_skip_time_act": False,
         "resnet_out_scale_factor": 1.0, "attention_type": "default", "dropout": 0.0, "mid_block_scale_factor": 1,
         "downsample_padding": 1}
INFORMATIONAL = {"sample_size", "attention_head_dim", "flip_sin_to_cos", "freq_shift", "norm_eps", "norm_num_groups",
                 "in_channels", "out_channels", "block_out_channels", "layers_per_block", "down_block_types",
                 "up_block_types", "cross_attention_dim", "addition_embed_type_num_heads"}


@dataclass(frozen=True)
class UNetConfig:
    in_channels: int = 8
    out_channels: int = 4
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    down_block_types: tuple[str, ...] = ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",)
    up_block_types: tuple[str, ...] = ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3
    layers_per_block: int = 2
    heads: tuple[int, ...] = (8, 8, 8, 8)  # per down block ("attention_head_dim" in SD-1.x configs)
    cross_attention_dim: int = 384
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    flip_sin_to_cos: bool = True
    freq_shift: float = 0.0

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> UNetConfig:
        """From musetalk.json; ValueError naming the first key this UNet does not implement."""
        check_keys(cfg, FIXED, INFORMATIONAL)
        channels = tuple(cfg.get("block_out_channels", cls.block_out_channels))
        heads = cfg.get("attention_head_dim", 8)
        heads = tuple(heads) if isinstance(heads, (list, tuple)) else (heads,) * len(channels)
        out = cls(cfg.get("in_channels", 8), cfg.get("out_channels", 4), channels,
                  tuple(cfg.get("down_block_types", cls.down_block_types)),
                  tuple(cfg.get("up_block_types", cls.up_block_types)), cfg.get("layers_per_block", 2), heads,
                  cfg.get("cross_attention_dim", 384), cfg.get("norm_num_groups", 32), cfg.get("norm_eps", 1e-5),
                  cfg.get("flip_sin_to_cos", True), cfg.get("freq_shift", 0))
        n = len(channels)
        if not (len(out.down_block_types) == len(out.up_block_types) == len(heads) == n):
            raise ValueError("block_out_channels, down_block_types, up_block_types and attention_head_dim "
                             "must have one entry per block")
        for kind in out.down_block_types:
            if kind not in DOWN_BLOCKS:
                raise ValueError(f"down block {kind!r} is not supported (only {', '.join(DOWN_BLOCKS)})")
        for kind in out.up_block_types:
            if kind not in UP_BLOCKS:
                raise ValueError(f"up block {kind!r} is not supported (only {', '.join(UP_BLOCKS)})")
        return out


def timestep_embedding(t: torch.Tensor, dim: int, flip_sin_to_cos: bool, shift: float) -> torch.Tensor:
    """[B] timesteps -> [B, dim] sinusoids (fp32), as SD-1.x embeds them."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / (half - shift))
    angles = t.float()[:, None] * freqs[None]
    emb = torch.cat([torch.cos(angles), torch.sin(angles)] if flip_sin_to_cos
                    else [torch.sin(angles), torch.cos(angles)], dim=-1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


class TimestepEmbedding(nn.Module):
    def __init__(self, channels: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(channels, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class GEGLU(nn.Module):
    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.proj = nn.Linear(dim, 2 * inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, gate = self.proj(x).chunk(2, dim=-1)
        return h * F.gelu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.net = nn.ModuleList([GEGLU(dim, 4 * dim), nn.Dropout(0.0), nn.Linear(4 * dim, dim)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[2](self.net[0](x))


class TransformerBlock(nn.Module):
    """Self-attention, cross-attention over the audio tokens, feed-forward; each pre-norm and residual."""

    def __init__(self, dim: int, heads: int, context_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.attn2 = Attention(dim, heads, context_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x = self.attn1.attend(self.norm1(x)) + x
        x = self.attn2.attend(self.norm2(x), context) + x
        return self.ff(self.norm3(x)) + x


class SpatialTransformer(nn.Module):
    """[B, C, H, W] -> GroupNorm -> 1x1 conv -> one TransformerBlock over the H*W tokens -> 1x1 conv, + input."""

    def __init__(self, channels: int, heads: int, context_dim: int, groups: int):
        super().__init__()
        self.norm = GroupNorm(groups, channels, eps=1e-6)
        self.proj_in = nn.Conv2d(channels, channels, 1)
        self.transformer_blocks = nn.ModuleList([TransformerBlock(channels, heads, context_dim)])
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        tokens = self.proj_in(self.norm(x)).permute(0, 2, 3, 1).reshape(b, h * w, c)
        tokens = self.transformer_blocks[0](tokens, context)
        return self.proj_out(tokens.reshape(b, h, w, c).permute(0, 3, 1, 2).contiguous()) + x


class DownBlock(nn.Module):
    """ResNet blocks (each followed by a SpatialTransformer where `cross`), then a stride-2 conv unless last.
    Returns its output and every intermediate map the up path concatenates back."""

    def __init__(self, channels: int, out: int, layers: int, c: UNetConfig, heads: int, temb: int,
                 cross: bool, downsample: bool):
        super().__init__()
        resnets, attentions = [], []
        for i in range(layers):  # made in checkpoint order: seeded random weights draw in the same order
            resnets.append(ResnetBlock(channels if i == 0 else out, out, c.norm_num_groups, c.norm_eps, temb))
            if cross:
                attentions.append(SpatialTransformer(out, heads, c.cross_attention_dim, c.norm_num_groups))
        self.resnets = nn.ModuleList(resnets)
        self.attentions = nn.ModuleList(attentions) if cross else None
        self.downsamplers = nn.ModuleList([Downsample(out, padding=1)]) if downsample else None

    def forward(self, x: torch.Tensor, temb: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, list]:
        skips = []
        for i, resnet in enumerate(self.resnets):
            x = resnet(x, temb)
            if self.attentions is not None:
                x = self.attentions[i](x, context)
            skips.append(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
            skips.append(x)
        return x, skips


class UpBlock(nn.Module):
    """Per layer: the next skip concatenated, a ResNet block (and a SpatialTransformer where `cross`);
    then a 2x upsample unless last."""

    def __init__(self, prev: int, out: int, skip_in: int, layers: int, c: UNetConfig, heads: int, temb: int,
                 cross: bool, upsample: bool):
        super().__init__()
        resnets, attentions = [], []
        for i in range(layers):
            resnets.append(ResnetBlock((prev if i == 0 else out) + (skip_in if i == layers - 1 else out), out,
                                       c.norm_num_groups, c.norm_eps, temb))
            if cross:
                attentions.append(SpatialTransformer(out, heads, c.cross_attention_dim, c.norm_num_groups))
        self.resnets = nn.ModuleList(resnets)
        self.attentions = nn.ModuleList(attentions) if cross else None
        self.upsamplers = nn.ModuleList([Upsample(out)]) if upsample else None

    def forward(self, x: torch.Tensor, skips: list[torch.Tensor], temb: torch.Tensor, context: torch.Tensor,
                upsample: str, size: tuple[int, int] | None) -> torch.Tensor:
        for i, resnet in enumerate(self.resnets):
            x = resnet(torch.cat([x, skips.pop()], dim=1), temb)
            if self.attentions is not None:
                x = self.attentions[i](x, context)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x, upsample, size)
        return x


class MidBlock(nn.Module):
    def __init__(self, channels: int, c: UNetConfig, heads: int, temb: int):
        super().__init__()
        first = ResnetBlock(channels, channels, c.norm_num_groups, c.norm_eps, temb)
        self.attentions = nn.ModuleList([SpatialTransformer(channels, heads, c.cross_attention_dim,
                                                            c.norm_num_groups)])
        self.resnets = nn.ModuleList([first, ResnetBlock(channels, channels, c.norm_num_groups, c.norm_eps, temb)])

    def forward(self, x: torch.Tensor, temb: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        x = self.resnets[0](x, temb)
        return self.resnets[1](self.attentions[0](x, context), temb)


class UNet(nn.Module):
    """[B, 8, 32, 32] latents (masked face, reference face) + [B, 50, 384] audio tokens -> [B, 4, 32, 32]."""

    def __init__(self, config: UNetConfig):
        super().__init__()
        c = self.config = config
        ch = c.block_out_channels
        temb = 4 * ch[0]
        self.conv_in = nn.Conv2d(c.in_channels, ch[0], 3, padding=1)
        self.time_embedding = TimestepEmbedding(ch[0], temb)
        last = len(ch) - 1
        self.down_blocks = nn.ModuleList([
            DownBlock(ch[max(i - 1, 0)], ch[i], c.layers_per_block, c, c.heads[i], temb,
                      cross=kind == "CrossAttnDownBlock2D", downsample=i < last)
            for i, kind in enumerate(c.down_block_types)])
        self.mid_block = MidBlock(ch[-1], c, c.heads[-1], temb)
        rch, rheads = ch[::-1], c.heads[::-1]
        self.up_blocks = nn.ModuleList([
            UpBlock(rch[max(i - 1, 0)], rch[i], rch[min(i + 1, last)], c.layers_per_block + 1, c, rheads[i], temb,
                    cross=kind == "CrossAttnUpBlock2D", upsample=i < last)
            for i, kind in enumerate(c.up_block_types)])
        self.conv_norm_out = GroupNorm(c.norm_num_groups, ch[0], eps=c.norm_eps)
        self.conv_out = nn.Conv2d(ch[0], c.out_channels, 3, padding=1)

    def time_embed(self, timestep: float, like: torch.Tensor) -> torch.Tensor:
        """[B, 4 * C0]: the time embedding of one timestep for each of `like`'s B samples, in its dtype.

        MuseTalk always runs at timestep 0, so this is a constant; it is computed in the step (small
        matmuls) to keep the module a plain function of its weights, at the batch's size because a
        matmul of one row rounds differently from one of B rows."""
        t = torch.full((like.shape[0],), float(timestep), device=like.device)
        sinusoids = timestep_embedding(t, self.config.block_out_channels[0], self.config.flip_sin_to_cos,
                                       self.config.freq_shift)
        return self.time_embedding(sinusoids.to(like.dtype))

    def forward(self, sample: torch.Tensor, context: torch.Tensor, timestep: float = 0.0,
                upsample: str = "plain") -> torch.Tensor:
        """`upsample`: "plain" or a mode prepared with blocks.fuse_upsamplers (models/blocks.py)."""
        temb = self.time_embed(timestep, sample)
        x = self.conv_in(sample)
        skips = [x]
        for block in self.down_blocks:
            x, more = block(x, temb, context)
            skips += more
        x = self.mid_block(x, temb, context)
        for i, block in enumerate(self.up_blocks):
            n = len(block.resnets)
            mine, skips = skips[-n:], skips[:-n]
            size = tuple(skips[-1].shape[-2:]) if skips else None  # the next block's skip: what to upsample to
            x = block(x, mine, temb, context, upsample, size)
        return self.conv_out(F.silu(self.conv_norm_out(x)))
