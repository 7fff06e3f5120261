"""Paste generated faces into I420 frames on the device that holds them.

The frame never leaves YUV 4:2:0: the face (RGB, 256x256) is resized into its box, converted to
YUV with the loop's colour matrix, and alpha-blended with the feathered mask: luma at full
resolution, chroma at half resolution on the chroma samples whose four pixels all lie in the
box. Every pixel outside the box keeps its exact Y, U and V, so it is bit-identical to the source.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from lipstream.avatar.colour import rgb_to_yuv, split_i420
from lipstream.media.pixels import MATRICES


def chroma_span(a: int, b: int) -> tuple[int, int]:
    """Chroma samples [c1, c2) whose two luma columns (or rows) both lie in [a, b)."""
    return (a + 1) // 2, b // 2


def untouched(height: int, width: int, boxes: list[list[int]]) -> np.ndarray:
    """[H*3/2, W] bool: the I420 samples that blending into these boxes must leave exactly as they were.

    Luma outside every box, and chroma outside every box's chroma span.
    """
    keep = np.ones((height * 3 // 2, width), bool)
    chroma = keep[height:].reshape(2, height // 2, width // 2)  # a view: writes go through
    for x1, y1, x2, y2 in boxes:
        keep[y1:y2, x1:x2] = False
        (cx1, cx2), (cy1, cy2) = chroma_span(x1, x2), chroma_span(y1, y2)
        chroma[:, cy1:cy2, cx1:cx2] = False
    return keep


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


def canvas_size(boxes: list[list[int]], height: int, width: int) -> tuple[int, int]:
    """(rows, cols) of a canvas that covers every box once placed at its even anchor: (even, even)."""
    ch = min(height, max(((y2 - (y1 & ~1)) + 1) & ~1 for _, y1, _, y2 in boxes))
    cw = min(width, max(((x2 - (x1 & ~1)) + 1) & ~1 for x1, _, x2, _ in boxes))
    return ch, cw


def blend_geometry(boxes: list[list[int]], height: int, width: int, canvas: tuple[int, int],
                   matrix: str) -> torch.Tensor:
    """[n, 9] float32 per box: canvas anchor (x, y), the box (x1, y1, x2, y2), the matrix's (Kr, Kg, Kb).

    Everything blend_static needs about a frame, as one tensor: a table of these per avatar frame
    lives on the device, so a batch's geometry is one gather, inside or outside a CUDA graph.
    """
    ch, cw = canvas
    kr, kb = MATRICES[matrix]
    rows = [[min(x1 & ~1, width - cw), min(y1 & ~1, height - ch), x1, y1, x2, y2, kr, 1 - kr - kb, kb]
            for x1, y1, x2, y2 in boxes]
    return torch.tensor(rows, dtype=torch.float64).float()


def blend_static(frames: torch.Tensor, faces: torch.Tensor, masks: torch.Tensor, geometry: torch.Tensor,
                 height: int, width: int, canvas: tuple[int, int]) -> None:
    """Blend a batch of faces into I420 frames in place, with nothing but tensor ops (graph-capturable).

    frames [n, H*3/2, W] uint8; faces [n, 3, S, S] RGB in [0, 1]; masks [n, S, S] uint8; geometry
    [n, 9] from blend_geometry. Each face is sampled onto a canvas of one fixed (even) size placed
    at its box's anchor; canvas pixels outside the box get alpha 0, so only their own values are
    written back. Luma and chroma are read and written with one gather / scatter each.
    """
    n = faces.shape[0]
    ch, cw = canvas
    dev = frames.device
    ax, ay, x1, y1, x2, y2, kr, kg, kb = geometry.unbind(1)
    xs = ax[:, None] + torch.arange(cw, device=dev)  # [n, cw] absolute columns
    ys = ay[:, None] + torch.arange(ch, device=dev)
    gx = (xs + 0.5 - x1[:, None]) / (x2 - x1)[:, None] * 2 - 1  # grid_sample coordinates, align_corners=False
    gy = (ys + 0.5 - y1[:, None]) / (y2 - y1)[:, None] * 2 - 1
    grid = torch.stack([gx[:, None, :].expand(n, ch, cw), gy[:, :, None].expand(n, ch, cw)], dim=-1)
    source = torch.cat([faces.float(), masks[:, None].float() / 255.0], dim=1)
    sampled = F.grid_sample(source, grid, mode="bilinear", padding_mode="border", align_corners=False)
    inside = (((xs >= x1[:, None]) & (xs < x2[:, None]))[:, None, :] & ((ys >= y1[:, None]) & (ys < y2[:, None]))[:, :, None])
    alpha = sampled[:, 3] * inside  # [n, ch, cw]
    r, g, b = sampled[:, :3].clamp(0, 1).unbind(1)
    kr, kg, kb = kr[:, None, None], kg[:, None, None], kb[:, None, None]
    yl = kr * r + kg * g + kb * b
    yuv = (16 + 219 * yl, 128 + 224 * ((b - yl) / (2 * (1 - kb))), 128 + 224 * ((r - yl) / (2 * (1 - kr))))

    flat = frames.view(n, -1)
    luma_at = (ys.long()[:, :, None] * width + xs.long()[:, None, :]).view(n, -1)
    luma = flat.gather(1, luma_at).view(n, ch, cw).float()
    luma = (luma * (1 - alpha) + yuv[0] * alpha).round_().clamp_(0, 255).to(torch.uint8)
    flat.scatter_(1, luma_at, luma.view(n, -1))
    # chroma samples whose 2x2 pixels all lie inside the box (see chroma_span)
    cxs, cys = xs[:, ::2] / 2, ys[:, ::2] / 2
    valid = (((cxs >= torch.div(x1 + 1, 2, rounding_mode="floor")[:, None]) &
              (cxs < torch.div(x2, 2, rounding_mode="floor")[:, None]))[:, None, :] &
             ((cys >= torch.div(y1 + 1, 2, rounding_mode="floor")[:, None]) &
              (cys < torch.div(y2, 2, rounding_mode="floor")[:, None]))[:, :, None])
    a_c = F.avg_pool2d(alpha[:, None], 2)[:, 0] * valid
    chroma_at = (cys.long()[:, :, None] * (width // 2) + cxs.long()[:, None, :]).view(n, -1)
    quarter = (height // 2) * (width // 2)
    for k, base in ((1, height * width), (2, height * width + quarter)):
        at = chroma_at + base
        current = flat.gather(1, at).view(n, ch // 2, cw // 2).float()
        weighted = F.avg_pool2d((alpha * yuv[k])[:, None], 2)[:, 0] * valid
        flat.scatter_(1, at, (current * (1 - a_c) + weighted).round_().clamp_(0, 255).to(torch.uint8).view(n, -1))


def blend_batch(frames: torch.Tensor, faces: torch.Tensor, masks: torch.Tensor, boxes: list[list[int]],
                height: int, width: int, matrix: str) -> None:
    """blend_into for a whole batch at once, in place (blend_static on a canvas fitted to these boxes)."""
    canvas = canvas_size(boxes, height, width)
    geometry = blend_geometry(boxes, height, width, canvas, matrix).to(frames.device, non_blocking=True)
    blend_static(frames, faces, masks, geometry, height, width, canvas)
