"""YUV 4:2:0 (I420) <-> RGB with an explicit colour matrix, in torch (CPU or GPU).

Frames stay in the decoder's I420 from input to encoder; RGB exists only for the face crops the
networks see. One matrix is chosen per video (its tag, else BT.601, FFmpeg's default for untagged
video) and used both ways, so a round trip does not shift colours.
"""

from __future__ import annotations

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


def _coefficients(matrix: str) -> tuple[float, float, float, float]:
    kr, kb = MATRICES[matrix]
    kg = 1 - kr - kb
    return kr, kg, kb, 0.0


def i420_to_rgb(y: torch.Tensor, u: torch.Tensor, v: torch.Tensor, matrix: str) -> torch.Tensor:
    """Planes y [..., H, W], u/v [..., H/2, W/2] uint8 -> RGB float [..., 3, H, W] in [0, 1].

    Chroma is upsampled by pixel replication (what FFmpeg's default fast path does).
    """
    kr, kg, kb, _ = _coefficients(matrix)
    yf = (y.float() - 16.0) / 219.0
    uf = (u.float() - 128.0) / 224.0
    vf = (v.float() - 128.0) / 224.0
    uf = uf.repeat_interleave(2, dim=-2).repeat_interleave(2, dim=-1)[..., : y.shape[-2], : y.shape[-1]]
    vf = vf.repeat_interleave(2, dim=-2).repeat_interleave(2, dim=-1)[..., : y.shape[-2], : y.shape[-1]]
    r = yf + 2 * (1 - kr) * vf
    b = yf + 2 * (1 - kb) * uf
    g = (yf - kr * r - kb * b) / kg
    return torch.stack([r, g, b], dim=-3).clamp_(0, 1)


def rgb_to_yuv(rgb: torch.Tensor, matrix: str) -> torch.Tensor:
    """RGB float [..., 3, H, W] in [0, 1] -> full-resolution Y, U, V float [..., 3, H, W] in code values."""
    kr, kg, kb, _ = _coefficients(matrix)
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
