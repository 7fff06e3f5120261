"""KeySync's video UNet: Stable Video Diffusion's spatio-temporal UNet as KeySync's keyframe and interpolation
models configure it, with speech as the only condition.

The speech of a clip of T frames ([B, T, 1024], projected by `AudioProjection`) enters twice: every frame's
spatial and temporal cross-attention reads all T tokens of its clip, and each frame's own token goes through
`label_emb` into that frame's time embedding. The input is the noisy latent (4 channels) with the reference
latent (keyframes: 8 channels) or the two keyframe latents and their indicator (interpolation: 9).

Module and parameter names are those of the published checkpoints (Stability's `sgm` code, under the
`model.diffusion_model.` prefix), so `keyframe_dub.pt` and `interpolation_dub.pt` load key for key. The
cross-attention keys and values are computed once per clip, not once per frame and pixel as the
reference repeats its context: the same numbers, fewer multiplications.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lipstream.models.unet import FeedForward, TransformerBlock, timestep_embedding
from lipstream.models.svd_vae import TimeConv, clip, unclip

GROUPS = 32  # every GroupNorm of the UNet (sgm's `normalization`)


@dataclass(frozen=True)
class KeySyncUNetConfig:
    """The `network_config.params` of KeySync's keyframe.yaml / interpolation.yaml that shape the network."""

    in_channels: int = 8  # keyframes; the interpolation model has 9
    out_channels: int = 4
    model_channels: int = 320
    channel_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attention_resolutions: tuple[int, ...] = (4, 2, 1)
    num_head_channels: int = 64
    context_dim: int = 1024
    audio_dim: int = 1024  # each frame's speech token into the time embedding (`audio_cond_method: both_keyframes`)

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> KeySyncUNetConfig:
        """From the yaml's `network_config.params`; keys that do not change the shapes are ignored."""
        names = {f.name for f in fields(cls)}
        kept = {k: tuple(v) if isinstance(v, list) else v for k, v in params.items() if k in names}
        return cls(**kept)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


KEYFRAME = KeySyncUNetConfig()
INTERPOLATION = KeySyncUNetConfig(in_channels=9)
TINY = KeySyncUNetConfig(model_channels=32, channel_mult=(1, 2), num_res_blocks=1, attention_resolutions=(1, 2),
                         num_head_channels=16, context_dim=24, audio_dim=24)


def _conv(temporal: bool, cin: int, cout: int) -> nn.Module:
    """A 3x3 convolution over each frame, or one over 3 neighbouring frames."""
    return TimeConv(cin, cout) if temporal else nn.Conv2d(cin, cout, 3, padding=1)


class ResBlock(nn.Module):
    """GroupNorm -> SiLU -> conv (+ the time embedding) -> GroupNorm -> SiLU -> conv, plus the input. Spatial
    (3x3 over [N, C, H, W]) or temporal (3 frames over [B, C, T, H, W], an embedding per frame)."""

    def __init__(self, channels: int, out_channels: int, emb_channels: int, temporal: bool = False):
        super().__init__()
        self.in_layers = nn.Sequential(nn.GroupNorm(GROUPS, channels), nn.SiLU(),
                                       _conv(temporal, channels, out_channels))
        self.emb_layers = nn.Sequential(nn.SiLU(), nn.Linear(emb_channels, out_channels))
        self.out_layers = nn.Sequential(nn.GroupNorm(GROUPS, out_channels), nn.SiLU(), nn.Identity(),
                                        _conv(temporal, out_channels, out_channels))
        self.skip_connection = (nn.Identity() if out_channels == channels  # never so over time: no 3-D 1x1
                                else nn.Conv2d(channels, out_channels, 1))
        self.temporal = temporal

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = self.in_layers(x)
        e = self.emb_layers(emb)  # [N, C], or [B, T, C] over time
        h = h + (e.transpose(1, 2)[..., None, None] if self.temporal else e[..., None, None])
        return self.skip_connection(x) + self.out_layers(h)


class Mixer(nn.Module):
    """sigmoid(mix_factor) of the spatial output, the rest of the temporal one (sgm's AlphaBlender, video input)."""

    def __init__(self):
        super().__init__()
        self.mix_factor = nn.Parameter(torch.tensor([0.5]))

    def forward(self, spatial: torch.Tensor, temporal: torch.Tensor) -> torch.Tensor:
        a = torch.sigmoid(self.mix_factor)
        return a * spatial + (1.0 - a) * temporal


class VideoResBlock(ResBlock):
    """A spatial ResBlock, then a temporal one over the clip's frames, mixed."""

    def __init__(self, channels: int, out_channels: int, emb_channels: int):
        super().__init__(channels, out_channels, emb_channels)
        self.time_stack = ResBlock(out_channels, out_channels, emb_channels, temporal=True)
        self.time_mixer = Mixer()

    def forward(self, x: torch.Tensor, emb: torch.Tensor, frames: int) -> torch.Tensor:
        x = clip(super().forward(x, emb), frames)
        t = self.time_stack(x, emb.unflatten(0, (-1, frames)))
        return unclip(self.time_mixer(x, t))


def _cross(attn: nn.Module, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """attn's output for queries `x` [N, L, C] over keys and values already projected [N, S, C]."""
    n, heads = x.shape[0], attn.heads
    q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (attn.to_q(x), k, v))
    out = F.scaled_dot_product_attention(q, k, v)
    return attn.to_out[0](out.transpose(1, 2).reshape(n, -1, x.shape[-1]))


class TemporalTransformerBlock(TransformerBlock):
    """Over each pixel's T frames: a feed-forward in, self-attention, cross-attention over the clip's speech
    tokens, a feed-forward; each pre-norm and residual (sgm's VideoTransformerBlock with `ff_in`)."""

    def __init__(self, dim: int, heads: int, context_dim: int):
        super().__init__(dim, heads, context_dim)
        self.norm_in = nn.LayerNorm(dim)
        self.ff_in = FeedForward(dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor, frames: int) -> torch.Tensor:
        """x [B*T, S, C] (S pixels), context [B, L, context_dim] -> [B*T, S, C]."""
        bt, s, c = x.shape
        b = bt // frames
        x = x.reshape(b, frames, s, c).transpose(1, 2).reshape(b * s, frames, c)
        x = self.ff_in(self.norm_in(x)) + x
        x = self.attn1.attend(self.norm1(x)) + x
        k, v = (p(context).repeat_interleave(s, dim=0) for p in (self.attn2.to_k, self.attn2.to_v))
        x = _cross(self.attn2, self.norm2(x), k, v) + x
        x = self.ff(self.norm3(x)) + x
        return x.reshape(b, s, frames, c).transpose(1, 2).reshape(bt, s, c)


class SpatialVideoTransformer(nn.Module):
    """GroupNorm -> linear in -> a spatial transformer block over each frame's pixels, mixed with a temporal one
    over each pixel's frames (frame positions embedded) -> linear out, plus the input."""

    def __init__(self, channels: int, heads: int, context_dim: int):
        super().__init__()
        self.norm = nn.GroupNorm(GROUPS, channels, eps=1e-6)
        self.proj_in = nn.Linear(channels, channels)
        self.transformer_blocks = nn.ModuleList([TransformerBlock(channels, heads, context_dim)])
        self.time_stack = nn.ModuleList([TemporalTransformerBlock(channels, heads, context_dim)])
        self.time_pos_embed = nn.Sequential(nn.Linear(channels, 4 * channels), nn.SiLU(),
                                            nn.Linear(4 * channels, channels))
        self.time_mixer = Mixer()
        self.proj_out = nn.Linear(channels, channels)

    def forward(self, x: torch.Tensor, context: torch.Tensor, frames: int) -> torch.Tensor:
        """x [B*T, C, H, W]; context [B, L, context_dim], the clip's tokens for each of its frames."""
        bt, c, h, w = x.shape
        tokens = self.proj_in(self.norm(x).flatten(2).transpose(1, 2))
        block = self.transformer_blocks[0]
        t = block.attn1.attend(block.norm1(tokens)) + tokens
        k, v = (p(context).repeat_interleave(frames, dim=0) for p in (block.attn2.to_k, block.attn2.to_v))
        t = _cross(block.attn2, block.norm2(t), k, v) + t
        spatial = block.ff(block.norm3(t)) + t
        position = timestep_embedding(torch.arange(frames, device=x.device), c, True, 0.0).to(x.dtype)
        position = self.time_pos_embed(position).repeat(bt // frames, 1)[:, None]
        temporal = self.time_stack[0](spatial + position, context, frames)
        tokens = self.proj_out(self.time_mixer(spatial, temporal))
        return tokens.transpose(1, 2).reshape(bt, c, h, w) + x


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.op = nn.Conv2d(channels, channels, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x)


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Stage(nn.ModuleList):
    """One entry of input_blocks / output_blocks: its layers in order (sgm's TimestepEmbedSequential)."""

    def forward(self, x: torch.Tensor, emb: torch.Tensor, context: torch.Tensor, frames: int) -> torch.Tensor:
        for layer in self:
            if isinstance(layer, VideoResBlock):
                x = layer(x, emb, frames)
            elif isinstance(layer, SpatialVideoTransformer):
                x = layer(x, context, frames)
            else:
                x = layer(x)
        return x


class KeySyncUNet(nn.Module):
    """[B*T, in_channels, h, w] latents of B clips of T frames -> [B*T, 4, h, w], v-prediction."""

    def __init__(self, config: KeySyncUNetConfig):
        super().__init__()
        self.config = c = config
        mc, emb = c.model_channels, 4 * c.model_channels
        self.time_embed = nn.Sequential(nn.Linear(mc, emb), nn.SiLU(), nn.Linear(emb, emb))
        self.label_emb = nn.Sequential(nn.Sequential(nn.Linear(c.audio_dim, emb), nn.SiLU(), nn.Linear(emb, emb)))

        def attention(ch: int) -> SpatialVideoTransformer:
            return SpatialVideoTransformer(ch, ch // c.num_head_channels, c.context_dim)

        self.input_blocks = nn.ModuleList([Stage([nn.Conv2d(c.in_channels, mc, 3, padding=1)])])
        skips, ch, ds = [mc], mc, 1
        for level, mult in enumerate(c.channel_mult):
            for _ in range(c.num_res_blocks):
                layers: list[nn.Module] = [VideoResBlock(ch, mult * mc, emb)]
                ch = mult * mc
                if ds in c.attention_resolutions:
                    layers.append(attention(ch))
                self.input_blocks.append(Stage(layers))
                skips.append(ch)
            if level != len(c.channel_mult) - 1:
                self.input_blocks.append(Stage([Downsample(ch)]))
                skips.append(ch)
                ds *= 2
        self.middle_block = Stage([VideoResBlock(ch, ch, emb), attention(ch), VideoResBlock(ch, ch, emb)])
        self.output_blocks = nn.ModuleList()
        for level, mult in reversed(list(enumerate(c.channel_mult))):
            for i in range(c.num_res_blocks + 1):
                layers = [VideoResBlock(ch + skips.pop(), mc * mult, emb)]
                ch = mc * mult
                if ds in c.attention_resolutions:
                    layers.append(attention(ch))
                if level and i == c.num_res_blocks:
                    layers.append(Upsample(ch))
                    ds //= 2
                self.output_blocks.append(Stage(layers))
        self.out = nn.Sequential(nn.GroupNorm(GROUPS, ch), nn.SiLU(), nn.Conv2d(mc, c.out_channels, 3, padding=1))

    def forward(self, x: torch.Tensor, c_noise: torch.Tensor, audio: torch.Tensor) -> torch.Tensor:
        """x [B*T, in, h, w]; c_noise [B*T] (the noise level, 0.25 ln sigma); audio [B, T, audio_dim]: the
        projected speech token of each frame (zeros where unconditioned)."""
        frames = audio.shape[1]
        emb = self.time_embed(timestep_embedding(c_noise, self.config.model_channels, True, 0.0).to(x.dtype))
        emb = emb + self.label_emb(audio.flatten(0, 1))
        h, hs = x, []
        for stage in self.input_blocks:
            h = stage(h, emb, audio, frames)
            hs.append(h)
        h = self.middle_block(h, emb, audio, frames)
        for stage in self.output_blocks:
            h = stage(torch.cat([h, hs.pop()], dim=1), emb, audio, frames)
        return self.out(h)


class AudioProjection(nn.Module):
    """Speech features [B, T, 2, 768] (two 50 Hz tokens a frame) -> [B, T, 1024]: their mean, then a linear
    layer (the reference's `WhisperAudioEmbedder`, whatever encoder made the features)."""

    def __init__(self, features: int = 768, dim: int = 1024):
        super().__init__()
        self.linear = nn.Linear(features, dim)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear(features.mean(dim=2))


class _Holder(nn.Module):
    """A bare module that only names its children, so the checkpoint's prefixes come out right."""


class KeySyncNet(nn.Module):
    """What one KeySync checkpoint holds besides the VAE, under the checkpoint's own names:
    `model.diffusion_model` (the UNet), `model.learned_mask` (interpolation: the latent that stands for the
    frames between the two keyframes) and `conditioner.embedders.2` (the speech projection)."""

    def __init__(self, config: KeySyncUNetConfig, features: int = 768, latent_size: int = 64):
        super().__init__()
        self.model = _Holder()
        self.model.diffusion_model = KeySyncUNet(config)
        if config.in_channels == 9:
            self.model.learned_mask = nn.Parameter(torch.zeros(4, latent_size, latent_size))
        self.conditioner = _Holder()
        self.conditioner.embedders = nn.ModuleList([nn.Identity(), nn.Identity(),
                                                    AudioProjection(features, config.context_dim)])

    @property
    def unet(self) -> KeySyncUNet:
        return self.model.diffusion_model

    @property
    def audio(self) -> AudioProjection:
        return self.conditioner.embedders[2]

    @property
    def interpolates(self) -> bool:
        return self.unet.config.in_channels == 9
