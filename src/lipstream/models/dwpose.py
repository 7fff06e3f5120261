"""DWPose (`dw-ll_ucoco_384.pth`, RTMPose-l whole-body at 384x288), the face tracker MuseTalk was trained with.

The network is a CSPNeXt-P5 backbone and an RTMCC head that reads each of the 133 keypoints as two
1-D classifications (SimCC: one over 576 x bins, one over 768 y bins, half a pixel each). Module and
parameter names are those of the published checkpoint's `state_dict` (`backbone.*`, `head.*`), so the
file loads key for key. Around it, as mmpose 1.1.0's `inference_topdown` does it for MuseTalk: a box
padded by 1.25 to the 3:4 input, ImageNet normalisation in RGB order, the flip test, the SimCC decode
and the map back to the frame; here as batched torch ops, so whole loops of frames run on the GPU.

Upstream warps the uint8 frame with cv2 (fixed-point bilinear); here it is `grid_sample` on the same
sampling grid, so crops may differ by one grey level where cv2 rounds its weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

INPUT_WIDTH, INPUT_HEIGHT = 288, 384  # the network's input, pixels (w, h)
STRIDE = 32  # the backbone's total downsampling: a 9 x 12 map of 108 tokens
SPLIT_RATIO = 2  # SimCC bins per input pixel
BOX_PADDING = 1.25  # mmpose GetBBoxCenterScale
ASPECT = INPUT_WIDTH / INPUT_HEIGHT  # 0.75: boxes are widened or heightened to this w/h
MEAN = (123.675, 116.28, 103.53)  # ImageNet, RGB, on 0-255
STD = (58.395, 57.12, 57.375)
KEYPOINTS = 133  # COCO-WholeBody: body 0-16, feet 17-22, face 23-90, hands 91-132
FACE = slice(23, 91)  # the 68 face points, in 300-W (iBUG) order
BN_EPS = 1e-5  # the config's SyncBN, not CSPNeXt's default 1e-3

# COCO-WholeBody's left/right swaps, as mmpose's dataset meta lists them: where keypoint i lands in a
# mirrored image. Face points mirror within the face; the two hands swap wholesale (91+j <-> 112+j).
FLIP_INDICES: tuple[int, ...] = (
    0, 2, 1, 4, 3, 6, 5, 8, 7, 10, 9, 12, 11, 14, 13, 16, 15, 20, 21, 22, 17, 18, 19,
    39, 38, 37, 36, 35, 34, 33, 32, 31, 30, 29, 28, 27, 26, 25, 24, 23,
    49, 48, 47, 46, 45, 44, 43, 42, 41, 40, 50, 51, 52, 53, 58, 57, 56, 55, 54,
    68, 67, 66, 65, 70, 69, 62, 61, 60, 59, 64, 63, 77, 76, 75, 74, 73, 72, 71,
    82, 81, 80, 79, 78, 87, 86, 85, 84, 83, 90, 89, 88,
    *range(112, 133), *range(91, 112),
)
assert len(FLIP_INDICES) == KEYPOINTS and sorted(FLIP_INDICES) == list(range(KEYPOINTS))
assert INPUT_WIDTH % STRIDE == 0 and INPUT_HEIGHT % STRIDE == 0


@dataclass(frozen=True)
class DWPoseConfig:
    """Widths and depths of the network; the input size and the 133 keypoints are fixed."""

    name: str
    widths: tuple[int, ...] = (64, 128, 256, 512, 1024)  # stem output, then each stage's output
    depths: tuple[int, ...] = (3, 6, 6, 3)  # CSPNeXt blocks per stage
    hidden: int = 256  # the GAU's token width
    expansion: int = 2  # GAU u/v width = expansion * hidden
    attention_dim: int = 128  # the GAU's shared q/k width ("s")
    kernel: int = 7  # the head's first conv


DWPOSE_SIZES: dict[str, DWPoseConfig] = {
    "full": DWPoseConfig("full"),  # RTMPose-l: widen 1.0, deepen 1.0
    # widen 0.125, one block a stage: mmdet's CSPNeXt builds the same (deepen 1/6 rounds every stage to 1)
    "tiny": DWPoseConfig("tiny", widths=(8, 16, 32, 64, 128), depths=(1, 1, 1, 1), hidden=16, attention_dim=8),
}


def dwpose_config(size: str) -> DWPoseConfig:
    if size not in DWPOSE_SIZES:
        raise ValueError(f"unknown DWPose size {size!r}; choose from {sorted(DWPOSE_SIZES)}")
    return DWPOSE_SIZES[size]


# ---------------------------------------------------------------------------------------------------------------
# The backbone: CSPNeXt-P5


class ConvBN(nn.Module):
    """Conv (no bias: a BatchNorm follows) -> BatchNorm -> SiLU, padded to keep the size ("same" at stride 1)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=BN_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(self.bn(self.conv(x)))


class DepthwiseSeparable(nn.Module):
    """A depthwise conv and a pointwise one, each with its BatchNorm and SiLU."""

    def __init__(self, cin: int, cout: int, kernel: int):
        super().__init__()
        self.depthwise_conv = ConvBN(cin, cin, kernel, groups=cin)
        self.pointwise_conv = ConvBN(cin, cout, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise_conv(self.depthwise_conv(x))


class CSPNeXtBlock(nn.Module):
    """3x3 conv then a 5x5 depthwise-separable conv, plus the input where `residual`."""

    def __init__(self, channels: int, residual: bool):
        super().__init__()
        self.conv1 = ConvBN(channels, channels, 3)
        self.conv2 = DepthwiseSeparable(channels, channels, 5)
        self.residual = residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(self.conv1(x))
        return y + x if self.residual else y


class ChannelAttention(nn.Module):
    """Each channel scaled by hardsigmoid(1x1 conv of the channels' spatial means)."""

    def __init__(self, channels: int):
        super().__init__()
        self.fc = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * F.hardsigmoid(self.fc(x.mean(dim=(2, 3), keepdim=True)))


class CSPLayer(nn.Module):
    """Half the channels through the blocks, half straight on; concatenated (blocks first), reweighted, mixed."""

    def __init__(self, channels: int, blocks: int, residual: bool):
        super().__init__()
        half = channels // 2
        self.main_conv = ConvBN(channels, half, 1)
        self.short_conv = ConvBN(channels, half, 1)
        self.final_conv = ConvBN(2 * half, channels, 1)
        self.blocks = nn.Sequential(*[CSPNeXtBlock(half, residual) for _ in range(blocks)])
        self.attention = ChannelAttention(2 * half)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([self.blocks(self.main_conv(x)), self.short_conv(x)], dim=1)
        return self.final_conv(self.attention(y))


class SPPBottleneck(nn.Module):
    """Spatial pyramid pooling: the map and its 5/9/13 max-pools (stride 1) side by side, then a 1x1 conv."""

    POOLS = (5, 9, 13)

    def __init__(self, channels: int):
        super().__init__()
        half = channels // 2
        self.conv1 = ConvBN(channels, half, 1)
        self.conv2 = ConvBN(half * (len(self.POOLS) + 1), channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        return self.conv2(torch.cat([x, *(F.max_pool2d(x, k, 1, k // 2) for k in self.POOLS)], dim=1))


class CSPNeXt(nn.Module):
    """[B, 3, H, W] -> [B, widths[-1], H/32, W/32]: a 3-conv stem (stride 2), then four stride-2 stages.

    Stages 1-3 add their blocks' inputs back; stage 4 does not, and pools a pyramid before its CSPLayer.
    """

    def __init__(self, c: DWPoseConfig):
        super().__init__()
        w = c.widths
        half = w[0] // 2
        self.stem = nn.Sequential(ConvBN(3, half, 3, 2), ConvBN(half, half, 3), ConvBN(half, w[0], 3))
        for i, blocks in enumerate(c.depths):
            last = i == len(c.depths) - 1
            layers = [ConvBN(w[i], w[i + 1], 3, 2)]
            if last:
                layers.append(SPPBottleneck(w[i + 1]))
            layers.append(CSPLayer(w[i + 1], blocks, residual=not last))
            self.add_module(f"stage{i + 1}", nn.Sequential(*layers))
        self.stages = len(c.depths)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for i in range(self.stages):
            x = getattr(self, f"stage{i + 1}")(x)
        return x


# ---------------------------------------------------------------------------------------------------------------
# The head: RTMCC (a conv to one map per keypoint, then a gated attention unit over the keypoints)


class ScaleNorm(nn.Module):
    """x / max(rms(x), eps) * g, over the last dimension: a LayerNorm with one scalar gain."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.scale = dim ** -0.5
        self.eps = eps
        self.g = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True) * self.scale
        return x / norm.clamp(min=self.eps) * self.g


class Scale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class GAU(nn.Module):
    """Gated attention unit over the K keypoint tokens: one squared-ReLU attention head whose q and k are
    per-dimension affine copies of one shared projection, gating u; the scaled input is added back."""

    def __init__(self, dim: int, expansion: int, attention_dim: int):
        super().__init__()
        self.e, self.s = expansion * dim, attention_dim
        self.gamma = nn.Parameter(torch.ones(2, self.s))
        self.beta = nn.Parameter(torch.zeros(2, self.s))
        self.o = nn.Linear(self.e, dim, bias=False)  # (the checkpoint's order)
        self.uv = nn.Linear(dim, 2 * self.e + self.s, bias=False)
        self.ln = ScaleNorm(dim)
        self.res_scale = Scale(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, v, base = torch.split(F.silu(self.uv(self.ln(x))), [self.e, self.e, self.s], dim=-1)
        q, k = (base[:, :, None, :] * self.gamma + self.beta).unbind(dim=2)
        kernel = F.relu(q @ k.transpose(1, 2) / math.sqrt(self.s)).square()  # [B, K, K]
        return self.res_scale(x) + self.o(u * (kernel @ v))


class RTMCCHead(nn.Module):
    """[B, C, 12, 9] -> SimCC logits ([B, K, 576] over x, [B, K, 768] over y): half-pixel bins of the input."""

    def __init__(self, c: DWPoseConfig):
        super().__init__()
        tokens = (INPUT_WIDTH // STRIDE) * (INPUT_HEIGHT // STRIDE)
        self.final_layer = nn.Conv2d(c.widths[-1], KEYPOINTS, c.kernel, padding=c.kernel // 2)
        self.mlp = nn.Sequential(ScaleNorm(tokens), nn.Linear(tokens, c.hidden, bias=False))
        self.gau = GAU(c.hidden, c.expansion, c.attention_dim)
        self.cls_x = nn.Linear(c.hidden, INPUT_WIDTH * SPLIT_RATIO, bias=False)
        self.cls_y = nn.Linear(c.hidden, INPUT_HEIGHT * SPLIT_RATIO, bias=False)

    def forward(self, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.gau(self.mlp(self.final_layer(feats).flatten(2)))
        return self.cls_x(x), self.cls_y(x)


class DWPose(nn.Module):
    """[B, 3, 384, 288] normalised RGB crops -> SimCC logits ([B, 133, 576], [B, 133, 768])."""

    def __init__(self, config: DWPoseConfig):
        super().__init__()
        self.config = config
        self.backbone = CSPNeXt(config)
        self.head = RTMCCHead(config)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.head(self.backbone(x))


# ---------------------------------------------------------------------------------------------------------------
# Pre- and post-processing, batched


def boxes_to_center_scale(boxes: torch.Tensor, padding: float = BOX_PADDING) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 4] (x1, y1, x2, y2) -> centres [B, 2] and sizes [B, 2] of the region the crop shows: the box
    padded by `padding`, then widened or heightened to the input's 3:4."""
    boxes = boxes.float()
    center = (boxes[:, :2] + boxes[:, 2:]) / 2
    w, h = ((boxes[:, 2:] - boxes[:, :2]) * padding).unbind(-1)
    wide = w > h * ASPECT
    scale = torch.stack([torch.where(wide, w, h * ASPECT), torch.where(wide, w / ASPECT, h)], dim=-1)
    return center, scale


def crop(frames: torch.Tensor, center: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[B, 3, H, W] RGB frames (uint8 or float on 0-255) -> [B, 3, 384, 288] normalised network input.

    Input pixel (u, v) shows frame point center + ((u, v) - (144, 192)) * scale / (288, 384): the affine
    map of mmpose's get_warp_matrix without rotation, pixel centres at integer coordinates, zeros outside
    the frame. Each batch item may have its own box; the warp is one grid_sample.
    """
    b, _, h, w = frames.shape
    dev = frames.device
    u = torch.arange(INPUT_WIDTH, device=dev, dtype=torch.float32) - INPUT_WIDTH / 2
    v = torch.arange(INPUT_HEIGHT, device=dev, dtype=torch.float32) - INPUT_HEIGHT / 2
    x = center[:, 0, None] + u * (scale[:, 0, None] / INPUT_WIDTH)  # [B, 288] frame coordinates
    y = center[:, 1, None] + v * (scale[:, 1, None] / INPUT_HEIGHT)  # [B, 384]
    gx = (2 * x + 1) / w - 1  # grid_sample, align_corners=False: pixel i's centre is at (2i+1)/W - 1
    gy = (2 * y + 1) / h - 1
    grid = torch.stack(torch.broadcast_tensors(gx[:, None, :], gy[:, :, None]), dim=-1)  # [B, 384, 288, 2]
    out = F.grid_sample(frames.float(), grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    if frames.dtype == torch.uint8:  # upstream warps the uint8 image: its crop is rounded back to uint8
        out = out.round().clamp(0, 255)
    mean = torch.tensor(MEAN, device=dev).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=dev).view(1, 3, 1, 1)
    return (out - mean) / std


def flip_test(net: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SimCC logits averaged with those of the mirrored crop, mapped back (keypoints swapped left/right,
    x bins reversed), as mmpose's flip test does: upstream's config runs with it on."""
    both_x, both_y = net(torch.cat([x, x.flip(-1)]))
    px, fx = both_x.chunk(2)
    py, fy = both_y.chunk(2)
    index = torch.tensor(FLIP_INDICES, device=x.device)
    return (px + fx[:, index].flip(-1)) / 2, (py + fy[:, index]) / 2


def decode_simcc(simcc_x: torch.Tensor, simcc_y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SimCC logits -> keypoints [B, K, 2] in input pixels and scores [B, K].

    Each axis's first maximal bin, divided by the split ratio; the score is the smaller of the two maxima
    (raw logits, not probabilities), and a keypoint whose score is <= 0 is put at (-1, -1) bins, as mmpose does.
    """
    vx, ix = simcc_x.max(dim=-1)
    vy, iy = simcc_y.max(dim=-1)
    score = torch.minimum(vx, vy)
    locs = torch.stack([ix, iy], dim=-1).float()
    locs = torch.where((score <= 0)[..., None], torch.full_like(locs, -1.0), locs)
    return locs / SPLIT_RATIO, score


def to_frame(points: torch.Tensor, center: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """[B, K, 2] input-pixel coordinates -> frame coordinates (the crop's map inverted, as mmpose writes it)."""
    size = torch.tensor([INPUT_WIDTH, INPUT_HEIGHT], device=points.device, dtype=points.dtype)
    return points / size * scale[:, None] + center[:, None] - scale[:, None] / 2


def keypoints(net: nn.Module, frames: torch.Tensor, boxes: torch.Tensor | None = None, *,
              flip: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """All 133 keypoints of one person per frame: [B, 133, 2] frame coordinates and [B, 133] scores.

    `frames` [B, 3, H, W] RGB (uint8 or 0-255 float); `boxes` [B, 4] (x1, y1, x2, y2), or None for the
    whole frame [0, 0, W, H] (what MuseTalk passes: no person detector). Runs where `frames` are.
    """
    b, _, h, w = frames.shape
    if boxes is None:
        boxes = torch.tensor([0.0, 0.0, w, h], device=frames.device).expand(b, 4)
    center, scale = boxes_to_center_scale(boxes.to(frames.device))
    p = next(net.parameters())
    x = crop(frames, center, scale).to(p.dtype)
    simcc = flip_test(net, x) if flip else net(x)
    points, scores = decode_simcc(*(s.float() for s in simcc))
    return to_frame(points, center, scale), scores


def face_landmarks(net: nn.Module, frames: torch.Tensor, boxes: torch.Tensor | None = None, *,
                   flip: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The 68 face points (keypoints 23-90, 300-W order) per frame: [B, 68, 2] and their scores [B, 68]."""
    points, scores = keypoints(net, frames, boxes, flip=flip)
    return points[:, FACE], scores[:, FACE]
