"""Whisper-tiny's audio encoder and its log-mel filters, as MuseTalk uses them: every hidden state kept.

Parameter names are those of the encoder in `whisper/model.safetensors` or `pytorch_model.bin`
(transformers' WhisperForConditionalGeneration, less the `model.encoder.` prefix), so the file loads
key for key. Unlike transformers' forward, this one takes any number of mel frames and the positions
they sit at in their 30 s segment: the live path encodes short windows (live/features.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lipstream.models.config import N_FFT, N_MELS, SAMPLE_RATE

FIXED = {"activation_function": "gelu", "scale_embedding": False, "is_encoder_decoder": True}


@dataclass(frozen=True)
class WhisperConfig:
    num_mel_bins: int = 80
    d_model: int = 384
    encoder_layers: int = 4
    encoder_attention_heads: int = 6
    encoder_ffn_dim: int = 1536
    max_source_positions: int = 1500

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> WhisperConfig:
        """From whisper/config.json (its decoder's keys are not read); ValueError on what this does not implement."""
        for key, want in FIXED.items():
            if key in cfg and cfg[key] != want:
                raise ValueError(f"{key} {cfg[key]!r} is not supported (only {want!r})")
        return cls(**{f: cfg[f] for f in cls.__dataclass_fields__ if f in cfg})


class EncoderAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.scaling = (dim // heads) ** -0.5
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim)
        self.q_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        split = lambda y: y.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q = split(self.q_proj(x) * self.scaling)  # scaled before the product, as Whisper does
        out = F.scaled_dot_product_attention(q, split(self.k_proj(x)), split(self.v_proj(x)), scale=1.0)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, d))


class EncoderLayer(nn.Module):
    def __init__(self, c: WhisperConfig):
        super().__init__()
        self.self_attn = EncoderAttention(c.d_model, c.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(c.d_model)
        self.fc1 = nn.Linear(c.d_model, c.encoder_ffn_dim)
        self.fc2 = nn.Linear(c.encoder_ffn_dim, c.d_model)
        self.final_layer_norm = nn.LayerNorm(c.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        x = x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:  # as Whisper's fp16 path: never an inf into the next layer
            limit = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-limit, limit)
        return x


class WhisperEncoder(nn.Module):
    """[B, 80, 2T] log-mel -> [B, T, 5, 384]: the embeddings and each layer's output (the last one
    layer-normed), stacked: the 5 hidden states MuseTalk's audio windows are made of."""

    def __init__(self, config: WhisperConfig):
        super().__init__()
        c = self.config = config
        self.conv1 = nn.Conv1d(c.num_mel_bins, c.d_model, 3, padding=1)
        self.conv2 = nn.Conv1d(c.d_model, c.d_model, 3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(c.max_source_positions, c.d_model)
        self.layers = nn.ModuleList([EncoderLayer(c) for _ in range(c.encoder_layers)])
        self.layer_norm = nn.LayerNorm(c.d_model)

    def forward(self, mel: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions` [B, T] (or [T]): where each output step sits in its 30 s segment (default 0..T-1)."""
        x = F.gelu(self.conv2(F.gelu(self.conv1(mel)))).permute(0, 2, 1)
        pos = self.embed_positions.weight
        h = x + (pos[: x.shape[1]] if positions is None else pos[positions])
        states = [h]
        for layer in self.layers:
            h = layer(h)
            states.append(h)
        states[-1] = self.layer_norm(h)
        return torch.stack(states, dim=2)


def sinusoids(length: int, channels: int) -> torch.Tensor:
    """Whisper's positional table (what embed_positions holds in the published checkpoints)."""
    log_timescale = np.log(10000) / (channels // 2 - 1)
    inv = torch.exp(-log_timescale * torch.arange(channels // 2, dtype=torch.float32))
    t = torch.arange(length, dtype=torch.float32)[:, None] * inv[None]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


def init_random_(encoder: WhisperEncoder) -> WhisperEncoder:
    """Whisper's initialisation (normal, std 0.02; zero biases; sinusoidal positions), for seeded random
    weights: drawn in transformers' order, so a seed gives the weights it gave before LipStream owned this."""
    with torch.no_grad():
        for m in encoder.modules():
            if isinstance(m, (nn.Linear, nn.Conv1d, nn.Embedding)):
                m.weight.normal_(0.0, 0.02)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
        encoder.embed_positions.weight.copy_(sinusoids(*encoder.embed_positions.weight.shape))
    return encoder


def _hz_to_mel(f: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear to 1 kHz, logarithmic above."""
    f = np.asarray(f, dtype=np.float64)
    logstep = 27.0 / np.log(6.4)
    return np.where(f >= 1000.0, 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) * logstep, 3.0 * f / 200.0)


def _mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    logstep = np.log(6.4) / 27.0
    return np.where(m >= 15.0, 1000.0 * np.exp(logstep * (m - 15.0)), 200.0 * m / 3.0)


@lru_cache(maxsize=4)
def mel_filters(n_mels: int = N_MELS, n_fft: int = N_FFT, rate: int = SAMPLE_RATE) -> np.ndarray:
    """[n_fft / 2 + 1, n_mels] float64: Whisper's triangular mel filter bank (Slaney scale and area norm,
    0 to rate / 2), the matrix its feature extractor multiplies the power spectrum by."""
    fft_freqs = np.linspace(0, rate // 2, n_fft // 2 + 1)
    mel_edges = np.linspace(_hz_to_mel(0.0), _hz_to_mel(rate / 2), n_mels + 2)
    edges = _mel_to_hz(mel_edges)
    slopes = edges[None, :] - fft_freqs[:, None]  # [bins, n_mels + 2]
    diffs = np.diff(edges)
    down = -slopes[:, :-2] / diffs[:-1]
    up = slopes[:, 2:] / diffs[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    filters *= (2.0 / (edges[2:n_mels + 2] - edges[:n_mels]))[None, :]
    filters.setflags(write=False)
    return filters
