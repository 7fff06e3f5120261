"""The SVD VAE (Stable Video Diffusion's AutoencoderKLTemporalDecoder), the VAE KeySync samples in.

The encoder is the SD VAE's, frame by frame (models/vae.py). The decoder decodes `frames` frames
together: after every ResNet block a temporal one (convolutions over 3 neighbouring frames, with
GroupNorm statistics over all of them) and a learned blend of the two; after the last convolution,
one more over 3 frames. So frames decoded together differ from frames decoded one at a time.
KeySync's inference decodes one at a time (`--decoding_t 1`); its latents were encoded with this
VAE (diffusers', from stable-video-diffusion-img2vid).

Parameter names are diffusers' (the `vae/` folder of stable-video-diffusion), so that file loads key
for key; KeySync's own checkpoints hold the decoder under sgm's names (`first_stage_model.decoder.*`).
Latents are unscaled here: callers apply 0.18215.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lipstream.models.blocks import Attention, GroupNorm, ResnetBlock, Upsample
from lipstream.models.config import check_keys
from lipstream.models.vae import EPS, Encoder, VAEConfig

FIXED = {"down_block_types": ["DownEncoderBlock2D"]}
INFORMATIONAL = {"sample_size", "scaling_factor", "force_upcast", "in_channels", "out_channels", "latent_channels",
                 "block_out_channels", "layers_per_block"}
TEMPORAL_EPS = 1e-5  # the temporal blocks' GroupNorm epsilon (the spatial ones' is 1e-6)
GROUPS = 32


@dataclass(frozen=True)
class SVDVAEConfig:
    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 4
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> SVDVAEConfig:
        """From vae/config.json; ValueError naming the first key this VAE does not implement."""
        check_keys(cfg, FIXED, INFORMATIONAL)
        return cls(cfg.get("in_channels", 3), cfg.get("out_channels", 3), cfg.get("latent_channels", 4),
                   tuple(cfg.get("block_out_channels", cls.block_out_channels)), cfg.get("layers_per_block", 2))

    @property
    def encoder(self) -> VAEConfig:
        return VAEConfig(self.in_channels, self.out_channels, self.latent_channels, self.block_out_channels,
                         self.layers_per_block, GROUPS)


def clip(x: torch.Tensor, frames: int) -> torch.Tensor:
    """[B*T, C, H, W] -> [B, C, T, H, W]."""
    bt, c, h, w = x.shape
    return x.reshape(bt // frames, frames, c, h, w).permute(0, 2, 1, 3, 4)


def unclip(x: torch.Tensor) -> torch.Tensor:
    """[B, C, T, H, W] -> [B*T, C, H, W]."""
    b, c, t, h, w = x.shape
    return x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)


class TimeConv(nn.Conv3d):
    """A convolution over 3 neighbouring frames (kernel 3x1x1, zero-padded in time), run as a 2-D one over
    [B, C, T, H*W]; a clip of one frame meets only the middle tap. The same sums as nn.Conv3d, cheaper
    kernels. Its parameters are nn.Conv3d's, so checkpoints load unchanged."""

    def __init__(self, channels: int, out_channels: int):
        super().__init__(channels, out_channels, (3, 1, 1), padding=(1, 0, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        if t == 1:
            return F.conv2d(x[:, :, 0], self.weight[:, :, 1], self.bias)[:, :, None]
        y = F.conv2d(x.reshape(b, c, t, h * w), self.weight[..., 0], self.bias, padding=(1, 0))
        return y.reshape(b, -1, t, h, w)


class TemporalResnetBlock(nn.Module):
    """The ResNet block over time: GroupNorm -> SiLU -> conv over 3 frames, twice, plus the input."""

    def __init__(self, channels: int, out_channels: int, eps: float = TEMPORAL_EPS, temb_channels: int | None = None):
        super().__init__()
        self.norm1 = nn.GroupNorm(GROUPS, channels, eps=eps)
        self.conv1 = TimeConv(channels, out_channels)
        self.time_emb_proj = nn.Linear(temb_channels, out_channels) if temb_channels else None
        self.norm2 = nn.GroupNorm(GROUPS, out_channels, eps=eps)
        self.conv2 = TimeConv(out_channels, out_channels)
        self.conv_shortcut = nn.Conv3d(channels, out_channels, 1) if channels != out_channels else None

    def forward(self, x: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        """[B, C, T, H, W]; `temb` [B, T, temb_channels] where the block has a time embedding."""
        h = self.conv1(F.silu(self.norm1(x)))
        if self.time_emb_proj is not None:
            h = h + self.time_emb_proj(F.silu(temb)).permute(0, 2, 1)[:, :, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h


class Blend(nn.Module):
    """The learned mix of a block's spatial and temporal outputs: sigmoid(mix_factor) of the temporal one."""

    def __init__(self, alpha: float = 0.0):
        super().__init__()
        self.mix_factor = nn.Parameter(torch.tensor([alpha]))

    def forward(self, spatial: torch.Tensor, temporal: torch.Tensor) -> torch.Tensor:
        a = torch.sigmoid(self.mix_factor)
        return (1.0 - a) * spatial + a * temporal


class SpatioTemporalResBlock(nn.Module):
    """A frame's ResNet block, then the clip's temporal one, blended."""

    def __init__(self, channels: int, out_channels: int, temb_channels: int | None = None):
        super().__init__()
        self.spatial_res_block = ResnetBlock(channels, out_channels, GROUPS, EPS, temb_channels)
        self.temporal_res_block = TemporalResnetBlock(out_channels, out_channels, TEMPORAL_EPS, temb_channels)
        self.time_mixer = Blend()

    def forward(self, x: torch.Tensor, frames: int, temb: torch.Tensor | None = None) -> torch.Tensor:
        """[B*T, C, H, W] -> [B*T, C', H, W]; `temb` [B*T, temb_channels] where the blocks have one."""
        spatial = clip(self.spatial_res_block(x, temb), frames)
        t = None if temb is None else temb.reshape(spatial.shape[0], frames, -1)
        return unclip(self.time_mixer(spatial, self.temporal_res_block(spatial, t)))


class MidBlock(nn.Module):
    def __init__(self, channels: int, layers: int):
        super().__init__()
        self.resnets = nn.ModuleList([SpatioTemporalResBlock(channels, channels) for _ in range(layers)])
        self.attentions = nn.ModuleList([Attention(channels, 1, bias=True, groups=GROUPS)])

    def forward(self, x: torch.Tensor, frames: int) -> torch.Tensor:
        x = self.resnets[0](x, frames)
        for resnet, attention in zip(self.resnets[1:], self.attentions):
            x = resnet(attention(x), frames)
        return x


class UpBlock(nn.Module):
    def __init__(self, channels: int, out: int, layers: int, upsample: bool):
        super().__init__()
        self.resnets = nn.ModuleList([SpatioTemporalResBlock(channels if i == 0 else out, out) for i in range(layers)])
        self.upsamplers = nn.ModuleList([Upsample(out)]) if upsample else None

    def forward(self, x: torch.Tensor, frames: int) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x, frames)
        return x if self.upsamplers is None else self.upsamplers[0](x)


class TemporalDecoder(nn.Module):
    def __init__(self, c: SVDVAEConfig):
        super().__init__()
        ch = c.block_out_channels[::-1]
        self.conv_in = nn.Conv2d(c.latent_channels, ch[0], 3, padding=1)
        self.mid_block = MidBlock(ch[0], c.layers_per_block)
        self.up_blocks = nn.ModuleList([UpBlock(ch[max(i - 1, 0)], ch[i], c.layers_per_block + 1, i < len(ch) - 1)
                                        for i in range(len(ch))])
        self.conv_norm_out = GroupNorm(GROUPS, ch[-1], eps=EPS)
        self.conv_out = nn.Conv2d(ch[-1], c.out_channels, 3, padding=1)
        self.time_conv_out = TimeConv(c.out_channels, c.out_channels)

    def forward(self, z: torch.Tensor, frames: int) -> torch.Tensor:
        """[B*T, 4, h, w] latents of B clips of T frames -> [B*T, 3, 8h, 8w] in about [-1, 1]."""
        x = self.mid_block(self.conv_in(z), frames)
        for up in self.up_blocks:
            x = up(x, frames)
        x = self.conv_out(F.silu(self.conv_norm_out(x)))
        return unclip(self.time_conv_out(clip(x, frames)))


class SVDVAE(nn.Module):
    """Frames in [-1, 1] <-> latents (unscaled); a clip's frames decode together."""

    def __init__(self, config: SVDVAEConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config.encoder)
        self.quant_conv = nn.Conv2d(2 * config.latent_channels, 2 * config.latent_channels, 1)
        self.decoder = TemporalDecoder(config)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] -> [N, 4, H/8, W/8]: the mean of the latent distribution, frame by frame."""
        return self.quant_conv(self.encoder(x))[:, :self.config.latent_channels]

    def decode(self, z: torch.Tensor, frames: int) -> torch.Tensor:
        """[B*T, 4, h, w] -> [B*T, 3, 8h, 8w]; `frames` = T, the frames of each clip decoded together."""
        if z.shape[0] % frames:
            raise ValueError(f"latents: {z.shape[0]} frames are not whole clips of {frames}")
        return self.decoder(z, frames)



# a decoder block's parts: sgm's names (VideoResBlock: a ResnetBlock, its time_stack and mix_factor) -> these
SGM_BLOCK = (("time_stack.in_layers.0.", "temporal_res_block.norm1."),
             ("time_stack.in_layers.2.", "temporal_res_block.conv1."),
             ("time_stack.out_layers.0.", "temporal_res_block.norm2."),
             ("time_stack.out_layers.3.", "temporal_res_block.conv2."),
             ("nin_shortcut.", "spatial_res_block.conv_shortcut."), ("norm1.", "spatial_res_block.norm1."),
             ("conv1.", "spatial_res_block.conv1."), ("norm2.", "spatial_res_block.norm2."),
             ("conv2.", "spatial_res_block.conv2."), ("mix_factor", "time_mixer.mix_factor"))
SGM_ATTENTION = {"norm": "group_norm", "q": "to_q", "k": "to_k", "v": "to_v", "proj_out": "to_out.0"}


def decoder_from_sgm(sd: dict[str, torch.Tensor], levels: int) -> dict[str, torch.Tensor]:
    """The decoder as Stability's sgm code names it (`VideoDecoder`; KeySync's checkpoints hold it under
    `first_stage_model.decoder.`, that prefix removed) -> this module's `decoder.` names. `levels`: resolution
    levels (4 in SVD; sgm's up.{i} runs last for i = 0). The attention's 1x1 convolutions become linear layers."""
    out = {}
    for name, t in sd.items():
        part = name.split(".")
        block = None
        if part[0] == "mid" and part[1] == "attn_1":
            linear = t.flatten(1) if t.ndim == 4 else t  # a 1x1 convolution's weight as a linear layer's
            out[f"decoder.mid_block.attentions.0.{SGM_ATTENTION[part[2]]}.{part[3]}"] = linear
            continue
        if part[0] == "mid":  # block_1, block_2
            block, inner = f"mid_block.resnets.{int(part[1][-1]) - 1}", ".".join(part[2:])
        elif part[0] == "up" and part[2] == "block":
            block, inner = f"up_blocks.{levels - 1 - int(part[1])}.resnets.{part[3]}", ".".join(part[4:])
        if block is not None:
            old, new = next((o, n) for o, n in SGM_BLOCK if inner.startswith(o))
            out[f"decoder.{block}.{new}{inner[len(old):]}"] = t
        elif part[0] == "up":  # up.{i}.upsample.conv
            out[f"decoder.up_blocks.{levels - 1 - int(part[1])}.upsamplers.0.{'.'.join(part[3:])}"] = t
        elif part[0] == "norm_out":
            out[f"decoder.conv_norm_out.{part[1]}"] = t
        elif part[:2] == ["conv_out", "time_mix_conv"]:
            out[f"decoder.time_conv_out.{part[2]}"] = t
        else:  # conv_in, conv_out
            out[f"decoder.{name}"] = t
    return out
