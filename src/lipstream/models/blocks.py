"""Building blocks the UNet and the VAE share: ResNet blocks, attention, down- and upsamplers, GroupNorm.

Module and parameter names are those of the published checkpoints (diffusers' layout), so the files
users download load into these modules key for key. Two of the engine's rewrites live here as plain
code, chosen per call:
- `Upsample(x, mode)`: nearest 2x + 3x3 conv as one convolution on the small map ("transpose", a
  stride-2 transposed conv with a 4x4 kernel, or "phases", four 2x2 convs interleaved): every output
  pixel of the pair reads only a 2x2 patch of the input, so taps that land on one input pixel share
  one weight, their sum. 16 instead of 36 multiply-adds per pixel and channel pair, and the
  upsampled copy is never written; only the order of the additions changes.
- `GroupNorm(x, near=True)`: the statistics of a face map whose top rows were cut off (the cropped
  decode, models/vae.py) guessed from the rows that are there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lipstream.models.config import UPSAMPLE_MODES


NEAR = 4  # near=True: the cut rows' moments are taken to be those of the first 1/NEAR of the rows there

# Rows of the 3x3 kernel (taps above, centre, below) folded onto the input rows they read.
_TRANSPOSE_FOLD = ((0, 0, 1), (0, 1, 1), (1, 1, 0), (1, 0, 0))  # kernel 4, stride 2, padding 1
_PHASE_FOLD = (((1, 0, 0), (0, 1, 1)),  # even output rows read input rows i-1, i
               ((1, 1, 0), (0, 0, 1)))  # odd output rows read input rows i, i+1


class GroupNorm(nn.GroupNorm):
    """nn.GroupNorm; with `near`, a map wider than tall (a square face map with its top rows cut) gets the
    whole map's statistics guessed: per group, the moments of the rows there combined with those of the
    cut rows, taken to equal the moments of the first 1/NEAR of the rows there (their neighbours)."""

    def forward(self, x: torch.Tensor, near: bool = False) -> torch.Tensor:
        b, c, h, w = x.shape if x.ndim == 4 else (0, 0, 1, 1)
        if not near or h >= w:
            return super().forward(x)
        cut, g = w - h, self.num_groups
        rows = x.float().reshape(b, g, c // g, h, w)
        m1, m2 = rows.mean(dim=(2, 4)), rows.square().mean(dim=(2, 4))  # [b, groups, h] per-row moments
        k = max(1, h // NEAR)
        mean = (h * m1.mean(-1) + cut * m1[..., :k].mean(-1)) / w
        square = (h * m2.mean(-1) + cut * m2[..., :k].mean(-1)) / w
        scale = torch.rsqrt((square - mean.square()).clamp(min=0) + self.eps)[..., None]
        y = ((rows.reshape(b, g, -1) - mean[..., None]) * scale).reshape(b, c, h, w)
        return (y * self.weight[:, None, None] + self.bias[:, None, None]).to(x.dtype)


class ResnetBlock(nn.Module):
    """GroupNorm -> SiLU -> 3x3 conv (+ the time embedding's projection) -> GroupNorm -> SiLU -> 3x3 conv,
    plus the input (through a 1x1 conv where the width changes)."""

    def __init__(self, channels: int, out_channels: int, groups: int, eps: float, temb_channels: int | None):
        super().__init__()
        self.norm1 = GroupNorm(groups, channels, eps=eps)
        self.conv1 = nn.Conv2d(channels, out_channels, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb_channels, out_channels) if temb_channels else None
        self.norm2 = GroupNorm(groups, out_channels, eps=eps)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(channels, out_channels, 1) if channels != out_channels else None

    def forward(self, x: torch.Tensor, temb: torch.Tensor | None = None, near: bool = False) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x, near)))
        if self.time_emb_proj is not None:
            h = h + self.time_emb_proj(F.silu(temb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h, near)))
        return (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h


class Attention(nn.Module):
    """Multi-head attention of `query_dim` tokens over themselves or over a context of `context_dim`.

    The UNet's form: no bias on q/k/v. The VAE's form (`spatial`): a GroupNorm first, biases, one head,
    on a [B, C, H, W] map, with the input added back."""

    def __init__(self, query_dim: int, heads: int, context_dim: int | None = None, *, bias: bool = False,
                 groups: int | None = None, eps: float = 1e-6):
        super().__init__()
        self.heads = heads
        self.group_norm = GroupNorm(groups, query_dim, eps=eps) if groups else None
        self.to_q = nn.Linear(query_dim, query_dim, bias=bias)
        self.to_k = nn.Linear(context_dim or query_dim, query_dim, bias=bias)
        self.to_v = nn.Linear(context_dim or query_dim, query_dim, bias=bias)
        self.to_out = nn.ModuleList([nn.Linear(query_dim, query_dim)])

    def attend(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        """[B, L, C] tokens (over [B, S, context_dim]) -> [B, L, C]."""
        context = x if context is None else context
        b, n = x.shape[0], self.heads
        q, k, v = (t.view(b, -1, n, t.shape[-1] // n).transpose(1, 2)
                   for t in (self.to_q(x), self.to_k(context), self.to_v(context)))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out[0](out.transpose(1, 2).reshape(b, -1, q.shape[1] * q.shape[3]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The VAE's spatial self-attention: [B, C, H, W] -> the same, the input added back."""
        b, c, h, w = x.shape
        tokens = self.group_norm(x).view(b, c, h * w).transpose(1, 2)
        # this order, as the checkpoint's own code adds them: the sum takes the (channels-last) view's memory
        # layout, which picks the next convolution's kernels
        return self.attend(tokens).transpose(1, 2).reshape(b, c, h, w) + x


class Downsample(nn.Module):
    """3x3 conv with stride 2. `padding` 0 pads one zero row and column at the bottom and right first
    (the VAE encoder), 1 pads all round (the UNet)."""

    def __init__(self, channels: int, padding: int):
        super().__init__()
        self.padding = padding
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)) if self.padding == 0 else x)


def _fold(weight: torch.Tensor, rows: tuple, cols: tuple) -> torch.Tensor:
    """[O, I, 3, 3] -> [O, I, len(rows), len(cols)]: each new tap sums the 3x3 taps that share its pixel."""
    r = torch.tensor(rows, dtype=torch.float64, device=weight.device)
    c = torch.tensor(cols, dtype=torch.float64, device=weight.device)
    return torch.einsum("ai,oxij,bj->oxab", r, weight.double(), c)


class Upsample(nn.Module):
    """Nearest 2x, then a 3x3 conv: "plain" as written, or fused into one convolution on the small map
    ("transpose", "phases": see the module docstring). A fused mode's weights are folded from the conv's
    by `fuse(mode)` once, kept as a buffer (not in the checkpoint), and shared by every caller."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def fuse(self, mode: str) -> None:
        if mode not in UPSAMPLE_MODES:
            raise ValueError(f"upsample mode must be one of {UPSAMPLE_MODES}, not {mode!r}")
        if mode == "plain" or hasattr(self, f"folded_{mode}"):
            return
        w = self.conv.weight.detach()
        if mode == "transpose":
            folded = _fold(w, _TRANSPOSE_FOLD, _TRANSPOSE_FOLD).transpose(0, 1)  # [I, O, 4, 4]
        else:
            folded = torch.cat([_fold(w, _PHASE_FOLD[a], _PHASE_FOLD[b]) for a in (0, 1) for b in (0, 1)])
        self.register_buffer(f"folded_{mode}", folded.to(w.dtype).contiguous(), persistent=False)

    def forward(self, x: torch.Tensor, mode: str = "plain", size: tuple[int, int] | None = None) -> torch.Tensor:
        """`size`: the output's, where it is not twice the input's (a UNet skip of odd size): plain then."""
        h, w = x.shape[-2:]
        if mode == "plain" or (size is not None and tuple(size) != (2 * h, 2 * w)):
            return self.conv(F.interpolate(x, size=size, scale_factor=None if size else 2.0, mode="nearest"))
        weight = getattr(self, f"folded_{mode}", None)
        if weight is None:
            raise RuntimeError(f"upsample mode {mode!r} was not prepared: call fuse({mode!r}) on the network first")
        if mode == "transpose":
            return F.conv_transpose2d(x, weight, self.conv.bias, stride=2, padding=1)
        y = F.conv2d(x, weight, padding=1).unflatten(1, (2, 2, -1))  # phase (a, b) sits a rows, b columns in
        rows = [torch.stack([y[:, a, b, :, a:a + h, b:b + w] for b in (0, 1)], dim=-1) for a in (0, 1)]
        out = torch.stack(rows, dim=3).flatten(4, 5).flatten(2, 3)  # [B, O, h, 2, w, 2] -> [B, O, 2h, 2w]
        return out + self.conv.bias[:, None, None]


def fuse_upsamplers(module: nn.Module, mode: str) -> None:
    """Prepare every Upsample in `module` for `mode` (after the weights are loaded and cast)."""
    for m in module.modules():
        if isinstance(m, Upsample):
            m.fuse(mode)
