"""The VAE decode of only the face rows the blend uses (`decode_rows="mask"`).

The blend mask is zero above the nose tip, so the upper rows of every decoded face are thrown
away. The decoder's cost is in its up blocks at 64-256 px (about 85% of its FLOPs), so those run
only from `row` (in latent rows, 8 px of the 256 px face) down; the mid block (whose attention
sees every position) and the first up block stay whole. Two things make it approximate: the
cropped top edge is zero-padded instead of seeing the rows above, and each GroupNorm's statistics
span the whole map, rows that were cut included. The edge stays far from the mask when `row` is a
few latent rows above its first non-zero row. For the statistics, `stats="near"` takes the cut
rows to look like the first quarter of the decoded rows (their neighbours) and combines their
moments with the decoded rows'; `stats="rows"` uses the decoded rows alone. On the H200
(benchmarks/core_variants.py, docs/BENCHMARKS.md: full-size random weights, 64 frames, worst
frame's face-box luma PSNR against eager fp32) "rows" from row 8 keeps 45.9 dB at 625 fps (full
decode: 70.5 dB, 526 fps); from row 6 53.4 dB, from row 10 42.6 dB. "near" costs 5% of the speed
(a per-row reduction); it helps at row 8 (47.6 dB) and hurts at row 6 (49.8 dB). Measure it with your weights.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from lipstream.engine.surgery import cached_variant, replace_modules, shared_copy
from lipstream.errors import InputError
from lipstream.models.config import LATENT_SIZE
from lipstream.options import DECODE_STATS as CUT_STATS

HALO = 4  # latent rows that must lie between the first decoded row and the mask's first non-zero row
# Of 32 latent rows (64 of 256 px). Masks start at the nose tip, below the middle of the box. Worst
# frame on the H200, "rows": row 6 53.4 dB, 8 45.9, 10 42.6; the old row-12 crop gave 38.3 (under the
# 40 dB bar). The CPU study (decode_crop_study, retired) was harsher: "rows" row 8 at 40.4 and "near" row 8 at
# 42.0. The default row is options.DEFAULT_DECODE_ROW.
NEAR = 4  # "near": the cut rows' moments are those of the first 1/NEAR of the decoded rows


class CutGroupNorm(nn.Module):
    """A GroupNorm for a map whose top rows were cut: statistics of the whole (square) map, guessed.

    Per group, the mean and mean square of the decoded rows are combined with those of the cut rows,
    taken to equal the moments of the first 1/NEAR of the decoded rows.
    """

    def __init__(self, norm: nn.GroupNorm):
        super().__init__()
        self.groups, self.eps, self.weight, self.bias = norm.num_groups, norm.eps, norm.weight, norm.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        cut = w - h  # the face maps are square before the cut
        if cut <= 0:
            return F.group_norm(x, self.groups, self.weight, self.bias, self.eps)
        rows = x.float().reshape(b, self.groups, c // self.groups, h, w)
        m1, m2 = rows.mean(dim=(2, 4)), rows.square().mean(dim=(2, 4))  # [b, groups, h] per-row moments
        k = max(1, h // NEAR)
        mean = (h * m1.mean(-1) + cut * m1[..., :k].mean(-1)) / w
        square = (h * m2.mean(-1) + cut * m2[..., :k].mean(-1)) / w
        var = (square - mean.square()).clamp(min=0)
        scale = torch.rsqrt(var + self.eps)[..., None]
        y = ((rows.reshape(b, self.groups, -1) - mean[..., None]) * scale).reshape(b, c, h, w)
        if self.weight is not None:
            y = y * self.weight[:, None, None] + self.bias[:, None, None]
        return y.to(x.dtype)


class CroppedDecoder(nn.Module):
    """A diffusers VAE `Decoder` run from latent row `row` down; the rows above come out as zeros.

    With `stats="near"` it works on a copy of the decoder (sharing its weights) whose GroupNorms
    after the cut are CutGroupNorms; the decoder passed in is left as it is.
    """

    def __init__(self, decoder: nn.Module, row: int, stats: str = "rows"):
        super().__init__()
        if not 0 <= row < LATENT_SIZE or len(decoder.up_blocks) < 2:
            raise ValueError(f"cannot crop the decode at latent row {row}")
        if stats not in CUT_STATS:
            raise ValueError(f"stats must be one of {CUT_STATS}, not {stats!r}")
        if stats == "near":
            decoder = cached_variant(decoder, "cut groupnorm", lambda: _with_cut_groupnorm(decoder))
        self.decoder = decoder
        self.row = row
        self.stats = stats

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


def _with_cut_groupnorm(decoder: nn.Module) -> nn.Module:
    """A copy of the decoder (same weights) whose GroupNorms after the first up block are CutGroupNorms."""
    decoder = shared_copy(decoder)
    swap: Callable[[nn.Module], nn.Module | None] = \
        lambda m: CutGroupNorm(m) if isinstance(m, nn.GroupNorm) else None  # noqa: E731
    for up in decoder.up_blocks[1:]:
        replace_modules(up, swap)
    decoder.conv_norm_out = swap(decoder.conv_norm_out) or decoder.conv_norm_out
    return decoder


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
