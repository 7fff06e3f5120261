"""Which avatars the cropped decode (`decode_rows="mask"`, models/vae.py's Decoder with `row`) can serve.

The blend mask is zero above the nose tip, so the decoder runs only from latent row `row` down. The
cut's top edge is zero-padded, so the mask must start a few latent rows (HALO) below it. On the H200
(benchmarks/gpu_core.py, docs/BENCHMARKS.md: full-size random weights, 64 frames, worst frame's
face-box luma PSNR against eager fp32) the "rows" statistics from row 8 keep 45.9 dB at 625 fps
(full decode: 70.5 dB, 526 fps); from row 6 53.4 dB, from row 10 42.6 dB. "near" (models/blocks.py
GroupNorm) costs 5% of the speed (a per-row reduction); it helps at row 8 (47.6 dB) and hurts at
row 6 (49.8 dB). Measure it with your weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lipstream.errors import InputError
from lipstream.models.config import LATENT_SIZE

HALO = 4  # latent rows that must lie between the first decoded row and the mask's first non-zero row
# Of 32 latent rows (64 of 256 px). Masks start at the nose tip, below the middle of the box. Worst
# frame on the H200, "rows": row 6 53.4 dB, 8 45.9, 10 42.6; the old row-12 crop gave 38.3 (under the
# 40 dB bar). The CPU study (decode_crop_study, retired) was harsher: "rows" row 8 at 40.4 and "near" row 8 at
# 42.0. The default row is options.DEFAULT_DECODE_ROW.


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
