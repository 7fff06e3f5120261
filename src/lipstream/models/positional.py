"""MuseTalk's fixed sinusoidal positional encoding over the 50 audio tokens of a frame."""

from __future__ import annotations

import math

import torch
from torch import nn

from lipstream.models.config import AUDIO_DIM


def sinusoidal_table(length: int, d_model: int = AUDIO_DIM) -> torch.Tensor:
    """[length, d_model] table: sin on even channels, cos on odd (Vaswani et al.), as upstream."""
    position = torch.arange(length, dtype=torch.float32)[:, None]
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(length, d_model)
    table[:, 0::2] = torch.sin(position * div_term)
    table[:, 1::2] = torch.cos(position * div_term)
    return table


class PositionalEncoding(nn.Module):
    """x [B, L, d_model] -> x + table[:L]. No weights: the table is a buffer, not in any checkpoint."""

    def __init__(self, d_model: int = AUDIO_DIM, max_len: int = 5000):
        super().__init__()
        self.register_buffer("pe", sinusoidal_table(max_len, d_model)[None], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pe[:, : x.shape[1]].to(x.dtype)
