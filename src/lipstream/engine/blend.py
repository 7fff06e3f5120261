"""Paste generated faces into I420 frames on the device that holds them.

The frame never leaves YUV 4:2:0: the face (RGB, 256x256) is resized into its box, converted to
YUV with the loop's colour matrix, and alpha-blended with the feathered mask: luma at full
resolution, chroma at half resolution on the chroma samples whose four pixels all lie in the
box. Every pixel outside the box keeps its exact Y, U and V, so it is bit-identical to the source.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lipstream.avatar.colour import rgb_to_yuv, split_i420


def chroma_span(a: int, b: int) -> tuple[int, int]:
    """Chroma samples [c1, c2) whose two luma columns (or rows) both lie in [a, b)."""
    return (a + 1) // 2, b // 2


def blend_into(frame: torch.Tensor, face: torch.Tensor, mask: torch.Tensor, box: torch.Tensor | list[int],
               height: int, width: int, matrix: str) -> None:
    """Blend one face into one I420 frame in place.

    frame [H*3/2, W] uint8; face [3, S, S] float RGB in [0, 1]; mask [S, S] uint8; box (x1, y1, x2, y2).
    """
    x1, y1, x2, y2 = (int(v) for v in box)
    h, w = y2 - y1, x2 - x1
    if h <= 0 or w <= 0:
        return
    size = (h, w)
    rgb = F.interpolate(face[None].float(), size=size, mode="bilinear", align_corners=False)[0]
    alpha = F.interpolate(mask[None, None].float() / 255.0, size=size, mode="bilinear", align_corners=False)[0, 0]
    yuv = rgb_to_yuv(rgb.clamp(0, 1), matrix)  # [3, h, w] code values
    y_plane, u_plane, v_plane = split_i420(frame, height, width)
    region = y_plane[y1:y2, x1:x2]
    region.copy_((region.float() * (1 - alpha) + yuv[0] * alpha).round_().clamp_(0, 255).to(torch.uint8))
    cx1, cx2 = chroma_span(x1, x2)
    cy1, cy2 = chroma_span(y1, y2)
    if cx2 <= cx1 or cy2 <= cy1:
        return
    ox, oy = 2 * cx1 - x1, 2 * cy1 - y1
    a = alpha[oy:oy + 2 * (cy2 - cy1), ox:ox + 2 * (cx2 - cx1)]
    a_c = F.avg_pool2d(a[None, None], 2)[0, 0]
    for plane, values in ((u_plane, yuv[1]), (v_plane, yuv[2])):
        weighted = F.avg_pool2d((a * values[oy:oy + 2 * (cy2 - cy1), ox:ox + 2 * (cx2 - cx1)])[None, None], 2)[0, 0]
        target = plane[cy1:cy2, cx1:cx2]
        target.copy_((target.float() * (1 - a_c) + weighted).round_().clamp_(0, 255).to(torch.uint8))


def crossfade(a: torch.Tensor, b: torch.Tensor, weight: float) -> torch.Tensor:
    """(1 - weight) * a + weight * b on uint8 I420 frames (YUV is linear enough for a dissolve)."""
    return (a.float() * (1 - weight) + b.float() * weight).round_().clamp_(0, 255).to(torch.uint8)
