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


def blend_batch(frames: torch.Tensor, faces: torch.Tensor, masks: torch.Tensor, boxes: list[list[int]],
                height: int, width: int, matrix: str) -> None:
    """blend_into for a whole batch at once, in place: one grid_sample for all faces and masks.

    Each face is sampled onto a canvas of one shared (even) size placed over its box; canvas
    pixels outside the box get alpha 0, so only their copy is written back, unchanged. `boxes` are
    plain ints (kept on the CPU), so nothing here waits for the GPU.
    """
    n = faces.shape[0]
    dev = frames.device
    ch = min(height, max(((y2 - (y1 & ~1)) + 1) & ~1 for _, y1, _, y2 in boxes))
    cw = min(width, max(((x2 - (x1 & ~1)) + 1) & ~1 for x1, _, x2, _ in boxes))
    anchors = [(min(x1 & ~1, width - cw), min(y1 & ~1, height - ch)) for x1, y1, _, _ in boxes]
    geo = torch.tensor([[ax, ay, x1, y1, x2, y2] for (ax, ay), (x1, y1, x2, y2) in zip(anchors, boxes)],
                       dtype=torch.float32).to(dev, non_blocking=True)
    ax, ay, x1, y1, x2, y2 = geo.unbind(1)
    xs = ax[:, None] + torch.arange(cw, device=dev)  # [n, cw] absolute columns
    ys = ay[:, None] + torch.arange(ch, device=dev)
    gx = (xs + 0.5 - x1[:, None]) / (x2 - x1)[:, None] * 2 - 1  # grid_sample coordinates, align_corners=False
    gy = (ys + 0.5 - y1[:, None]) / (y2 - y1)[:, None] * 2 - 1
    grid = torch.stack([gx[:, None, :].expand(n, ch, cw), gy[:, :, None].expand(n, ch, cw)], dim=-1)
    source = torch.cat([faces.float(), masks[:, None].float() / 255.0], dim=1)
    sampled = F.grid_sample(source, grid, mode="bilinear", padding_mode="border", align_corners=False)
    inside = (((xs >= x1[:, None]) & (xs < x2[:, None]))[:, None, :] & ((ys >= y1[:, None]) & (ys < y2[:, None]))[:, :, None])
    alpha = sampled[:, 3] * inside  # [n, ch, cw]
    yuv = rgb_to_yuv(sampled[:, :3].clamp(0, 1), matrix)  # [n, 3, ch, cw]

    planes = [split_i420(frames[i], height, width) for i in range(n)]
    luma = torch.stack([p[0][a[1]:a[1] + ch, a[0]:a[0] + cw] for p, a in zip(planes, anchors)]).float()
    luma = (luma * (1 - alpha) + yuv[:, 0] * alpha).round_().clamp_(0, 255).to(torch.uint8)
    # chroma samples whose 2x2 pixels all lie inside the box (see chroma_span)
    cxs, cys = xs[:, ::2] / 2, ys[:, ::2] / 2
    valid = (((cxs >= torch.div(x1 + 1, 2, rounding_mode="floor")[:, None]) &
              (cxs < torch.div(x2, 2, rounding_mode="floor")[:, None]))[:, None, :] &
             ((cys >= torch.div(y1 + 1, 2, rounding_mode="floor")[:, None]) &
              (cys < torch.div(y2, 2, rounding_mode="floor")[:, None]))[:, :, None])
    a_c = F.avg_pool2d(alpha[:, None], 2)[:, 0] * valid
    chroma = []
    for k in (1, 2):
        current = torch.stack([p[k][a[1] // 2:(a[1] + ch) // 2, a[0] // 2:(a[0] + cw) // 2]
                               for p, a in zip(planes, anchors)]).float()
        weighted = F.avg_pool2d((alpha * yuv[:, k])[:, None], 2)[:, 0] * valid
        chroma.append((current * (1 - a_c) + weighted).round_().clamp_(0, 255).to(torch.uint8))
    for i, ((px, py), p) in enumerate(zip(anchors, planes)):
        p[0][py:py + ch, px:px + cw].copy_(luma[i])
        p[1][py // 2:(py + ch) // 2, px // 2:(px + cw) // 2].copy_(chroma[0][i])
        p[2][py // 2:(py + ch) // 2, px // 2:(px + cw) // 2].copy_(chroma[1][i])
