"""The VAE decode of only the face rows the blend uses (`decode_rows="mask"`).

The blend mask is zero above the nose tip, so the upper rows of every decoded face are thrown
away. The decoder's cost is in its up blocks at 64-256 px (about 85% of its FLOPs), so those run
only from `row` (in latent rows, 8 px of the 256 px face) down; the mid block (whose attention
sees every position) and the first up block stay whole. Two things make it approximate: the
cropped top edge is zero-padded instead of seeing the rows above, and each GroupNorm takes its
statistics over the decoded rows only. Both stay far from the mask when `row` is a few latent rows
above its first non-zero row; measure the PSNR against the full decode before relying on it.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lipstream.errors import InputError
from lipstream.models.config import LATENT_SIZE

DECODE_ROWS = ("full", "mask", "auto")  # auto: the mask rows where every avatar of a batch allows it
HALO = 4  # latent rows that must lie between the first decoded row and the mask's first non-zero row
# Of 32 latent rows (48 of 256 px). Masks start at the nose tip, below the middle of the box. A CPU
# study (benchmarks/decode_crop_study.py, docs/results/decode_crop_study_cpu.json) of face-box PSNR
# against the full decode, worst of 16 frames: row 12 36.7 dB, 8 40.4, 6 42.5, 4 45.4.
DEFAULT_ROW = 6


class CroppedDecoder(nn.Module):
    """A diffusers VAE `Decoder` run from latent row `row` down; the rows above come out as zeros."""

    def __init__(self, decoder: nn.Module, row: int):
        super().__init__()
        if not 0 <= row < LATENT_SIZE or len(decoder.up_blocks) < 2:
            raise ValueError(f"cannot crop the decode at latent row {row}")
        self.decoder = decoder
        self.row = row

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        d = self.decoder
        x = d.mid_block(d.conv_in(z), None)
        x = d.up_blocks[0](x, None)  # whole: its output is at twice the latent resolution
        scale = x.shape[-2] // z.shape[-2]
        x = x[:, :, scale * self.row:]
        for up in d.up_blocks[1:]:
            x = up(x, None)
        x = d.conv_out(d.conv_act(d.conv_norm_out(x)))
        return F.pad(x, (0, 0, x.shape[-1] - x.shape[-2], 0))  # back to a square face


def first_mask_row(masks: torch.Tensor) -> int:
    """The first pixel row (of the mask's own size) where any frame's mask is non-zero."""
    rows = (masks.amax(dim=(0, 2)) > 0).nonzero()
    return int(rows[0]) if rows.numel() else masks.shape[-2]


def mask_fits(masks: torch.Tensor, row: int) -> bool:
    """Whether an avatar's masks start at or below what a decode from latent `row` covers (with its halo)."""
    return first_mask_row(masks) >= (row + HALO) * (masks.shape[-2] // LATENT_SIZE)


def check_mask_fits(masks: torch.Tensor, row: int, path: str | Path) -> None:
    """Raise if an avatar's masks reach above what a decode from latent `row` covers (with its halo)."""
    if not mask_fits(masks, row):
        first = first_mask_row(masks)
        pixels_per_row = masks.shape[-2] // LATENT_SIZE
        raise InputError(path, f"its blend mask starts at face row {first}, above what a decode from latent row "
                               f"{row} covers (row {(row + HALO) * pixels_per_row} at the earliest); render it "
                               "with --decode-rows full")
