"""Band-limited resampling in torch, so it runs on the GPU next to the features.

Windowed-sinc polyphase filter (Hann window, 6 zero crossings, roll-off 0.99: the design
torchaudio and Julius use), applied with one strided conv1d. libswresample, called frame by
frame from Python, costs ~100 ms per minute of 48 kHz stereo on a CPU core; this is one kernel.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
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


class StreamResampler:
    """`resample` over audio that arrives in chunks: the same samples as resampling it whole.

    An output block needs `half` input samples past it, so each push returns the blocks whose
    inputs are all in, and `flush` the rest (zeros past the end, as `resample` pads). numpy on
    the CPU, one matrix product a push: it runs on the caller's thread (a live session's event
    loop), where torch's many small ops would each drop and retake the GIL.
    """

    def __init__(self, orig_rate: int, new_rate: int):
        g = math.gcd(orig_rate, new_rate)
        self.orig, self.new = orig_rate // g, new_rate // g
        kernel, self.half = _kernel(self.orig, self.new, torch.device("cpu"), torch.float32)
        self.kernel_t = np.ascontiguousarray(kernel[:, 0, :].numpy().T)  # [K, new]
        self.x = np.zeros(0, np.float32)
        self.n = 0  # input samples so far
        self.blocks = 0  # output blocks (of `new` samples) emitted

    def push(self, chunk: np.ndarray) -> np.ndarray:
        chunk = np.asarray(chunk, np.float32).reshape(-1)
        self.n += chunk.size
        if self.orig == self.new:
            return chunk
        self.x = np.concatenate([self.x, chunk])
        return self._emit((self.n - self.half) // self.orig)

    def flush(self) -> np.ndarray:
        if self.orig == self.new:
            return np.zeros(0, np.float32)
        total = math.ceil(self.new * self.n / self.orig)  # what `resample` returns for all of it
        before = self.blocks * self.new
        return self._emit(-(-total // self.new))[:max(0, total - before)]

    def _emit(self, upto: int) -> np.ndarray:
        """Output blocks [self.blocks, upto); input past what has arrived reads zeros."""
        if upto <= self.blocks:
            return np.zeros(0, np.float32)
        offset = self.n - self.x.size  # input index of self.x[0]
        lo, hi = self.blocks * self.orig - self.half, upto * self.orig + self.half
        segment = np.zeros(hi - lo, np.float32)
        part = self.x[max(0, lo - offset):max(0, hi - offset)]
        pad_left = max(0, offset - lo)
        segment[pad_left:pad_left + part.size] = part
        windows = np.lib.stride_tricks.sliding_window_view(segment, self.kernel_t.shape[0])[::self.orig]
        y = (windows[:upto - self.blocks] @ self.kernel_t).reshape(-1)  # block-major, phase-minor
        self.blocks = upto
        self.x = self.x[max(0, self.blocks * self.orig - self.half - offset):]  # what later blocks still read
        return y
