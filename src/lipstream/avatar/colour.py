"""YUV 4:2:0 (I420) <-> RGB with an explicit colour matrix, in torch (CPU or GPU).

Frames stay in the decoder's I420 from input to encoder; RGB exists only for the face crops the
networks see. One matrix is chosen per video (its tag, else BT.601, FFmpeg's default for untagged
video) and used both ways, so a round trip does not shift colours.
"""

from __future__ import annotations

import torch

from lipstream.media.pixels import yuv_to_rgb_affine  # the numpy half (MATRICES too) lives there, torch-free
from lipstream.media.pixels import matrix_coefficients as _coefficients


def rgb_to_yuv(rgb: torch.Tensor, matrix: str) -> torch.Tensor:
    """RGB float [..., 3, H, W] in [0, 1] -> full-resolution Y, U, V float [..., 3, H, W] in code values."""
    kr, kg, kb = _coefficients(matrix)
    r, g, b = rgb.unbind(-3)
    yl = kr * r + kg * g + kb * b
    u = (b - yl) / (2 * (1 - kb))
    v = (r - yl) / (2 * (1 - kr))
    return torch.stack([16 + 219 * yl, 128 + 224 * u, 128 + 224 * v], dim=-3)


def split_i420(frame: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed I420 frame [..., H*3/2, W] (PyAV's layout) -> views of Y [H, W], U and V [H/2, W/2]."""
    y = frame[..., :height, :]
    chroma = frame[..., height:, :].reshape(*frame.shape[:-2], 2, height // 2, width // 2)
    return y, chroma[..., 0, :, :], chroma[..., 1, :, :]


def i420_to_rgb(frames: torch.Tensor, height: int, width: int, matrix: str) -> torch.Tensor:
    """[..., H*3/2, W] uint8 I420 -> [..., H, W, 3] uint8 RGB (chroma upsampled by repetition), in torch."""
    y, u, v = split_i420(frames, height, width)
    up = lambda c: c.repeat_interleave(2, -2).repeat_interleave(2, -1)  # noqa: E731
    yuv = torch.stack([y, up(u), up(v)], dim=-1).float()
    affine = torch.from_numpy(yuv_to_rgb_affine(matrix)).float().to(frames.device)
    rgb = yuv @ affine[:, :3].T + affine[:, 3]
    return rgb.round_().clamp_(0, 255).to(torch.uint8)
