"""WavLM (Base+), the speech encoder of KeySync's interpolation model: 16 kHz samples -> 768-d tokens at 50 Hz.

HuBERT's shape (models/hubert.py: strided convolutions, a convolution over 128 frames for positions,
post-norm transformer layers) with one addition: a learned bias on every attention score by the distance
between the two frames (320 log-spaced buckets, computed once in the first layer), scaled per layer, head
and frame by a gate computed from that frame's input. Parameter names are those of Microsoft's
`WavLM-Base+.pt` (`model`, built from its `cfg`), so the file loads key for key.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lipstream.models.hubert import WeightNormConv1d

FIXED = {"extractor_mode": "default", "activation_fn": "gelu", "conv_bias": False, "relative_position_embedding": True,
         "gru_rel_pos": True}


@dataclass(frozen=True)
class WavLMConfig:
    encoder_layers: int = 12
    encoder_embed_dim: int = 768
    encoder_ffn_embed_dim: int = 3072
    encoder_attention_heads: int = 12
    conv_feature_layers: str = "[(512,10,5)] + [(512,3,2)] * 4 + [(512,2,2)] * 2"
    layer_norm_first: bool = False
    normalize: bool = False  # a layer norm over the whole input first (the Large model)
    conv_pos: int = 128
    conv_pos_groups: int = 16
    num_buckets: int = 320
    max_distance: int = 800

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> WavLMConfig:
        """From the checkpoint's `cfg`; ValueError naming the first setting this encoder does not implement.
        Settings that only matter in training (dropout, masking) are ignored."""
        for key, want in FIXED.items():
            if key in cfg and cfg[key] != want:
                raise ValueError(f"{key} {cfg[key]!r} is not supported (only {want!r})")
        if cfg.get("layer_norm_first"):
            raise ValueError("layer_norm_first True is not supported (only False: Base and Base+)")
        return cls(**{f.name: cfg[f.name] for f in fields(cls) if f.name in cfg})

    @property
    def conv_layers(self) -> list[tuple[int, int, int]]:
        """(channels, kernel, stride) of each feature convolution, from the checkpoint's Python-list string."""
        layers = _list_expression(ast.parse(self.conv_feature_layers, mode="eval").body)
        if not layers or any(len(t) != 3 for t in layers):
            raise ValueError(f"conv_feature_layers {self.conv_feature_layers!r}: not a list of (dim, kernel, stride)")
        return layers


def _list_expression(node: ast.AST) -> list:
    """Lists of int tuples joined by + and repeated by *, as fairseq writes conv_feature_layers (no eval)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _list_expression(node.left) + _list_expression(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult) and isinstance(node.right, ast.Constant):
        return _list_expression(node.left) * int(node.right.value)
    value = ast.literal_eval(node)
    if not isinstance(value, list):
        raise ValueError("conv_feature_layers: expected a list")
    return [tuple(v) for v in value]


class FeatureExtractor(nn.Module):
    """conv_layers.i = (conv, dropout, [GroupNorm, first only], GELU), as fairseq's Sequential indexes them."""

    def __init__(self, layers: list[tuple[int, int, int]]):
        super().__init__()
        blocks, cin = [], 1
        for i, (dim, kernel, stride) in enumerate(layers):
            parts = [nn.Conv1d(cin, dim, kernel, stride=stride, bias=False), nn.Identity()]
            parts += [nn.GroupNorm(dim, dim), nn.GELU()] if i == 0 else [nn.GELU()]
            blocks.append(nn.Sequential(*parts))
            cin = dim
        self.conv_layers = nn.ModuleList(blocks)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        first = self.conv_layers[0]
        x = first[0](wave[:, None])
        x = first[3](first[2](x.float()).to(x.dtype))  # the GroupNorm in fp32, as fairseq's Fp32GroupNorm
        for block in self.conv_layers[1:]:
            x = block(x)
        return x.transpose(1, 2)


def relative_buckets(length: int, num_buckets: int, max_distance: int, device: torch.device) -> torch.Tensor:
    """[L, L] bucket of key j seen from query i: exact below 80 frames each way, log-spaced to max_distance."""
    position = torch.arange(length, device=device)
    relative = position[None, :] - position[:, None]
    half = num_buckets // 2
    buckets = (relative > 0).long() * half
    distance = relative.abs()
    exact = half // 2
    far = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact) * (half - exact)).long()
    far = torch.clamp(far, max=half - 1)
    return buckets + torch.where(distance < exact, distance, far)


class GatedSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, num_buckets: int | None):
        super().__init__()
        self.heads = heads
        self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.q_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        if num_buckets:
            self.relative_attention_bias = nn.Embedding(num_buckets, heads)
        self.grep_linear = nn.Linear(dim // heads, 8)
        self.grep_a = nn.Parameter(torch.ones(1, heads, 1, 1))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x [B, L, C]; bias [H, L, L], the distance bias before this layer's gate."""
        b, n, c = x.shape
        gate_a, gate_b = torch.sigmoid(self.grep_linear(x.view(b, n, self.heads, -1).transpose(1, 2))
                                       .view(b, self.heads, n, 2, 4).sum(-1)).chunk(2, dim=-1)
        gated = (gate_a * (gate_b * self.grep_a - 1.0) + 2.0) * bias  # [B, H, L, 1] * [H, L, L]
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=gated.to(q.dtype))
        return self.out_proj(out.transpose(1, 2).reshape(b, n, c))


class EncoderLayer(nn.Module):
    def __init__(self, c: WavLMConfig, first: bool):
        super().__init__()
        self.self_attn = GatedSelfAttention(c.encoder_embed_dim, c.encoder_attention_heads,
                                            c.num_buckets if first else None)
        self.self_attn_layer_norm = nn.LayerNorm(c.encoder_embed_dim)
        self.fc1 = nn.Linear(c.encoder_embed_dim, c.encoder_ffn_embed_dim)
        self.fc2 = nn.Linear(c.encoder_ffn_embed_dim, c.encoder_embed_dim)
        self.final_layer_norm = nn.LayerNorm(c.encoder_embed_dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = self.self_attn_layer_norm(x + self.self_attn(x, bias))
        return self.final_layer_norm(x + self.fc2(F.gelu(self.fc1(x))))


class Encoder(nn.Module):
    def __init__(self, c: WavLMConfig):
        super().__init__()
        self.config = c
        # (weight-normalised grouped conv, same-pad trim, GELU) as fairseq's Sequential: only the conv holds weights
        self.pos_conv = nn.ModuleList([WeightNormConv1d(c.encoder_embed_dim, c.conv_pos, c.conv_pos_groups)])
        self.layers = nn.ModuleList([EncoderLayer(c, i == 0) for i in range(c.encoder_layers)])
        self.layer_norm = nn.LayerNorm(c.encoder_embed_dim)
        self._remove = 1 if c.conv_pos % 2 == 0 else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pos_conv[0](x.transpose(1, 2))
        x = self.layer_norm(x + F.gelu(y[:, :, :y.shape[2] - self._remove]).transpose(1, 2))
        c = self.config
        buckets = relative_buckets(x.shape[1], c.num_buckets, c.max_distance, x.device)
        bias = self.layers[0].self_attn.relative_attention_bias(buckets).permute(2, 0, 1)  # [H, L, L]
        for layer in self.layers:
            x = layer(x, bias)
        return x


class WavLM(nn.Module):
    """[B, S] samples at 16 kHz -> [B, N, 768] tokens of the last layer, N = (S - 400) // 320 + 1."""

    def __init__(self, config: WavLMConfig):
        super().__init__()
        self.config = config
        layers = config.conv_layers
        self.feature_extractor = FeatureExtractor(layers)
        self.layer_norm = nn.LayerNorm(layers[-1][0])
        self.post_extract_proj = nn.Linear(layers[-1][0], config.encoder_embed_dim)
        self.mask_emb = nn.Parameter(torch.zeros(config.encoder_embed_dim))  # training's masking: unused
        self.encoder = Encoder(config)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        if self.config.normalize:
            wave = F.layer_norm(wave, wave.shape[-1:])
        features = self.layer_norm(self.feature_extractor(wave))
        return self.encoder(self.post_extract_proj(features))
