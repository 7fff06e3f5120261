"""YUV 4:2:0 (I420) <-> RGB with an explicit colour matrix, in torch (CPU or GPU).

Frames stay in the decoder's I420 from input to encoder; RGB exists only for the face crops the
networks see. One matrix is chosen per video (its tag, else BT.601, FFmpeg's default for untagged
video) and used both ways, so a round trip does not shift colours.
"""

from __future__ import annotations

import numpy as np
import torch

# (Kr, Kb) of each matrix; limited ("TV") range: Y in [16, 235], Cb/Cr in [16, 240].
MATRICES = {"bt709": (0.2126, 0.0722), "bt601": (0.299, 0.114)}


def default_matrix(tagged: str | None = None) -> str:
    """'bt709' or 'bt601' from a stream's colour-space tag (FFmpeg's names); untagged -> 'bt601'."""
    if tagged:
        t = tagged.lower().replace("-", "").replace("_", "")
        if "709" in t:
            return "bt709"
        if "601" in t or "470" in t or "170" in t or t in ("smpte170m", "bt470bg"):
            return "bt601"
    return "bt601"


def _coefficients(matrix: str) -> tuple[float, float, float]:
    kr, kb = MATRICES[matrix]
    return kr, 1 - kr - kb, kb


def yuv_to_rgb_affine(matrix: str) -> np.ndarray:
    """[3, 4] affine map from 8-bit (Y, U, V) code values to 8-bit (R, G, B), for cv2.transform."""
    kr, kg, kb = _coefficients(matrix)
    to_rgb = np.array([[1, 0, 2 * (1 - kr)],
                       [1, -2 * (1 - kb) * kb / kg, -2 * (1 - kr) * kr / kg],
                       [1, 2 * (1 - kb), 0]])  # rows: R, G, B from (y, u, v) normalised
    norm = np.diag([1 / 219, 1 / 224, 1 / 224])
    offset = -norm @ np.array([16.0, 128.0, 128.0])
    m = 255 * to_rgb @ norm
    return np.hstack([m, (255 * to_rgb @ offset)[:, None]]).astype(np.float64)


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
