"""Nearest 2x upsampling + 3x3 convolution as one convolution on the small map (exact).

After a nearest 2x upsample, every output pixel of the 3x3 convolution reads only a 2x2 patch of
the small input: the taps that land on the same input pixel can share one weight, their sum. So
the pair is one stride-2 transposed convolution with a 4x4 kernel ("transpose"), or four 2x2
convolutions, one per output phase, interleaved ("phases"). Either does 16 instead of 36
multiply-adds per small-map pixel and channel pair, and never writes the upsampled copy. The VAE
decoder's three upsamplers are 28% of its FLOPs. Only the order of the additions changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lipstream.engine.surgery import cached_variant, replace_modules, shared_copy
from lipstream.options import UPSAMPLE_MODES

FUSED_MODES = tuple(m for m in UPSAMPLE_MODES if m != "plain")

# Rows of the 3x3 kernel (taps above, centre, below) folded onto the input rows they read.
_TRANSPOSE_FOLD = ((0, 0, 1), (0, 1, 1), (1, 1, 0), (1, 0, 0))  # kernel 4, stride 2, padding 1
_PHASE_FOLD = (((1, 0, 0), (0, 1, 1)),  # even output rows read input rows i-1, i
               ((1, 1, 0), (0, 0, 1)))  # odd output rows read input rows i, i+1


def _fold(weight: torch.Tensor, rows: tuple, cols: tuple) -> torch.Tensor:
    """[O, I, 3, 3] -> [O, I, len(rows), len(cols)]: each new tap sums the 3x3 taps that share its pixel."""
    r = torch.tensor(rows, dtype=torch.float64, device=weight.device)
    c = torch.tensor(cols, dtype=torch.float64, device=weight.device)
    return torch.einsum("ai,oxij,bj->oxab", r, weight.double(), c)


class FusedUpsample(nn.Module):
    """A diffusers `Upsample2D` (nearest 2x, then a 3x3 conv) as one convolution on its input."""

    def __init__(self, upsample: nn.Module, mode: str):
        super().__init__()
        if mode not in FUSED_MODES:
            raise ValueError(f"mode must be one of {FUSED_MODES}, not {mode!r}")
        if not can_fuse(upsample):
            raise ValueError("only a nearest 2x upsample followed by a 3x3, padding-1 convolution can be fused")
        conv: nn.Conv2d = upsample.conv
        w = conv.weight.detach()
        if mode == "transpose":
            folded = _fold(w, _TRANSPOSE_FOLD, _TRANSPOSE_FOLD).transpose(0, 1)  # [I, O, 4, 4]
        else:
            folded = torch.cat([_fold(w, _PHASE_FOLD[a], _PHASE_FOLD[b]) for a in (0, 1) for b in (0, 1)])
        self.mode = mode
        self.weight = nn.Parameter(folded.to(w.dtype).contiguous(memory_format=_format(w)), requires_grad=False)
        self.bias = conv.bias
        self.plain = upsample  # other output sizes (odd skip connections in a UNet) take the plain path

    def forward(self, x: torch.Tensor, output_size: tuple[int, int] | None = None, *args, **kwargs) -> torch.Tensor:
        h, w = x.shape[-2:]
        if output_size is not None and tuple(output_size) != (2 * h, 2 * w):
            return self.plain(x, output_size)
        if self.mode == "transpose":
            return F.conv_transpose2d(x, self.weight, self.bias, stride=2, padding=1)
        y = F.conv2d(x, self.weight, padding=1)  # [B, 4 O, h + 1, w + 1]: phase (a, b) sits a rows, b columns in
        y = y.unflatten(1, (2, 2, -1))
        rows = [torch.stack([y[:, a, b, :, a:a + h, b:b + w] for b in (0, 1)], dim=-1) for a in (0, 1)]
        out = torch.stack(rows, dim=3).flatten(4, 5).flatten(2, 3)  # [B, O, h, 2, w, 2] -> [B, O, 2h, 2w]
        return out if self.bias is None else out + self.bias[:, None, None]


def _format(t: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous() \
        else torch.contiguous_format


def can_fuse(module: nn.Module) -> bool:
    conv = getattr(module, "conv", None)
    return (type(module).__name__ == "Upsample2D" and getattr(module, "interpolate", False)
            and getattr(module, "use_conv", False) and not getattr(module, "use_conv_transpose", True)
            and getattr(module, "norm", None) is None and isinstance(conv, nn.Conv2d)
            and conv.kernel_size == (3, 3) and conv.padding == (1, 1) and conv.stride == (1, 1)
            and conv.dilation == (1, 1) and conv.groups == 1)


def fuse_upsamplers(module: nn.Module, mode: str) -> nn.Module:
    """A copy of `module` (sharing its parameters and buffers) with every fusable upsampler fused.

    A copy, not an edit: the reference path and other engines keep using the original modules.
    One copy per module and mode (folded from the weights as they are at the first call).
    """
    if mode == "plain":
        return module

    def fuse() -> nn.Module:
        fused = shared_copy(module)
        replace_modules(fused, lambda m: FusedUpsample(m, mode) if can_fuse(m) else None)
        return fused

    return cached_variant(module, ("upsample", mode), fuse)
