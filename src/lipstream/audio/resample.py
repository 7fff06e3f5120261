"""Band-limited resampling in torch, so it runs on the GPU next to the features.

Windowed-sinc polyphase filter (Hann window, 6 zero crossings, roll-off 0.99: the design
torchaudio and Julius use), applied with one strided conv1d. libswresample, called frame by
frame from Python, costs ~100 ms per minute of 48 kHz stereo on a CPU core; this is one kernel.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

ZERO_CROSSINGS = 6
ROLLOFF = 0.99


@lru_cache(maxsize=16)
def _kernel(orig: int, new: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """[new, 1, K] filters, one per output phase, and the half-width in input samples."""
    cutoff = min(orig, new) * ROLLOFF
    half = math.ceil(ZERO_CROSSINGS * orig / cutoff)
    taps = torch.arange(-half, half + orig, dtype=torch.float64) / orig  # input positions
    phases = -torch.arange(new, dtype=torch.float64)[:, None] / new  # output sub-positions
    t = ((phases + taps[None]) * cutoff).clamp(-ZERO_CROSSINGS, ZERO_CROSSINGS)
    window = torch.cos(t * math.pi / ZERO_CROSSINGS / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t.where(t != 0, torch.ones_like(t)))
    kernel = (sinc * window * cutoff / orig)[:, None, :]
    return kernel.to(device=device, dtype=dtype), half


def resample(x: torch.Tensor, orig_rate: int, new_rate: int) -> torch.Tensor:
    """[n] samples at orig_rate -> [ceil(n * new / orig)] at new_rate, on x's device."""
    if orig_rate == new_rate:
        return x
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    kernel, half = _kernel(orig, new, x.device, x.dtype)
    n = x.shape[-1]
    padded = F.pad(x.reshape(1, 1, n), (half, half + orig))
    y = F.conv1d(padded, kernel, stride=orig)  # [1, new, L]: phase-major
    y = y.transpose(1, 2).reshape(-1)
    return y[: math.ceil(new * n / orig)]
