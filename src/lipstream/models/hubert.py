"""HuBERT (base), the speech encoder of KeySync's keyframe model: 16 kHz samples -> 768-d tokens at 50 Hz.

Seven strided 1-D convolutions (the first with a per-channel GroupNorm) turn the samples into 512-d frames
every 20 ms; a LayerNorm and a linear layer project them to 768; a grouped convolution over 128 frames
(weight-normalised) adds positions; a LayerNorm; twelve post-norm transformer layers. KeySync reads the
last layer's output. Parameter names are those of facebook/hubert-base-ls960 (transformers' HubertModel,
as its files store them, `weight_g`/`weight_v` for the normalised convolution), so the file loads key for key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lipstream.models.config import check_keys

FIXED = {"feat_extract_norm": "group", "feat_extract_activation": "gelu", "hidden_act": "gelu",
         "do_stable_layer_norm": False, "conv_bias": False, "feat_proj_layer_norm": True,
         "conv_pos_batch_norm": False, "num_feat_extract_layers": 7}
INFORMATIONAL = {
    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "conv_dim", "conv_kernel",
    "conv_stride", "num_conv_pos_embeddings", "num_conv_pos_embedding_groups", "layer_norm_eps",
    # training only (dropout, masking, the CTC head's), or bookkeeping
    "activation_dropout", "attention_dropout", "feat_proj_dropout", "hidden_dropout", "hidden_dropout_prob",
    "final_dropout", "layerdrop", "mask_time_prob", "mask_time_length", "mask_time_min_masks",
    "mask_feature_prob", "mask_feature_length", "mask_feature_min_masks", "apply_spec_augment", "ctc_loss_reduction",
    "ctc_zero_infinity", "use_weighted_layer_sum", "classifier_proj_size", "vocab_size", "pad_token_id",
    "bos_token_id", "eos_token_id", "initializer_range", "gradient_checkpointing", "architectures", "model_type",
    "transformers_version", "torch_dtype", "dtype", "_name_or_path", "feat_extract_dropout", "tokenizer_class",
    "output_hidden_size"}


@dataclass(frozen=True)
class HuBERTConfig:
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    conv_dim: tuple[int, ...] = (512,) * 7
    conv_kernel: tuple[int, ...] = (10, 3, 3, 3, 3, 2, 2)
    conv_stride: tuple[int, ...] = (5, 2, 2, 2, 2, 2, 2)
    num_conv_pos_embeddings: int = 128
    num_conv_pos_embedding_groups: int = 16
    layer_norm_eps: float = 1e-5

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> HuBERTConfig:
        """From the model's config.json; ValueError naming the first key this encoder does not implement."""
        check_keys(cfg, FIXED, INFORMATIONAL)
        kept = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items() if k in cls.__dataclass_fields__}
        return cls(**kept)


class ConvLayer(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int, norm: bool):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, stride=stride, bias=False)
        if norm:
            self.layer_norm = nn.GroupNorm(cout, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        return F.gelu(self.layer_norm(x) if hasattr(self, "layer_norm") else x)


class FeatureEncoder(nn.Module):
    def __init__(self, c: HuBERTConfig):
        super().__init__()
        dims = (1,) + c.conv_dim
        self.conv_layers = nn.ModuleList([ConvLayer(dims[i], dims[i + 1], c.conv_kernel[i], c.conv_stride[i], i == 0)
                                          for i in range(len(c.conv_dim))])

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        x = wave[:, None]
        for layer in self.conv_layers:
            x = layer(x)
        return x.transpose(1, 2)


class FeatureProjection(nn.Module):
    def __init__(self, c: HuBERTConfig):
        super().__init__()
        self.layer_norm = nn.LayerNorm(c.conv_dim[-1], eps=c.layer_norm_eps)
        self.projection = nn.Linear(c.conv_dim[-1], c.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projection(self.layer_norm(x))


class WeightNormConv1d(nn.Module):
    """A grouped Conv1d whose weight is g * v / |v|, the norm over all but the kernel axis (weight_norm, dim=2)."""

    def __init__(self, channels: int, kernel: int, groups: int):
        super().__init__()
        self.weight_g = nn.Parameter(torch.ones(1, 1, kernel))
        # drawn as fairseq draws it (a zero v has no direction: random networks need one)
        scale = (4 / (kernel * channels)) ** 0.5
        self.weight_v = nn.Parameter(torch.randn(channels, channels // groups, kernel) * scale)
        self.bias = nn.Parameter(torch.zeros(channels))
        self.groups, self.padding = groups, kernel // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = torch._weight_norm(self.weight_v, self.weight_g, 2)
        return F.conv1d(x, weight, self.bias, padding=self.padding, groups=self.groups)


class PositionalConvEmbedding(nn.Module):
    def __init__(self, c: HuBERTConfig):
        super().__init__()
        self.conv = WeightNormConv1d(c.hidden_size, c.num_conv_pos_embeddings, c.num_conv_pos_embedding_groups)
        self.remove = 1 if c.num_conv_pos_embeddings % 2 == 0 else 0  # an even kernel gives one frame too many

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x.transpose(1, 2))
        return F.gelu(y[:, :, :y.shape[2] - self.remove]).transpose(1, 2)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = (p(x).view(b, n, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, c))


class FeedForward(nn.Module):
    def __init__(self, dim: int, inner: int):
        super().__init__()
        self.intermediate_dense = nn.Linear(dim, inner)
        self.output_dense = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_dense(F.gelu(self.intermediate_dense(x)))


class EncoderLayer(nn.Module):
    """Post-norm: x = LN(x + attention(x)); x = LN(x + feed_forward(x))."""

    def __init__(self, c: HuBERTConfig):
        super().__init__()
        self.attention = SelfAttention(c.hidden_size, c.num_attention_heads)
        self.layer_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.feed_forward = FeedForward(c.hidden_size, c.intermediate_size)
        self.final_layer_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm(x + self.attention(x))
        return self.final_layer_norm(x + self.feed_forward(x))


class Encoder(nn.Module):
    def __init__(self, c: HuBERTConfig):
        super().__init__()
        self.pos_conv_embed = PositionalConvEmbedding(c)
        self.layer_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.layers = nn.ModuleList([EncoderLayer(c) for _ in range(c.num_hidden_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm(x + self.pos_conv_embed(x))
        for layer in self.layers:
            x = layer(x)
        return x


class HuBERT(nn.Module):
    """[B, S] samples at 16 kHz -> [B, N, hidden] tokens, N = (S - 400) // 320 + 1 (20 ms apart)."""

    def __init__(self, config: HuBERTConfig):
        super().__init__()
        self.config = config
        self.feature_extractor = FeatureEncoder(config)
        self.feature_projection = FeatureProjection(config)
        self.encoder = Encoder(config)
        self.masked_spec_embed = nn.Parameter(torch.zeros(config.hidden_size))  # training's masking: unused

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.feature_projection(self.feature_extractor(wave)))
