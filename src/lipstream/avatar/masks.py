"""Feathered lower-face blend masks from landmarks, one per frame, in its box's 256x256 space.

The mask covers the jaw region from the nose tip down to the chin (lips, mouth, jaw) and is
zero above, so the generated face never replaces the eyes. It fades to zero inside
the jaw line and box edges, so the blend has no seam. Upstream MuseTalk uses a face-parsing net
for this; no package ships one, and the landmark polygon gives the same region.
"""

from __future__ import annotations

import cv2
import numpy as np

from lipstream.models.config import CROP_SIZE

JAW = slice(0, 17)
NOSE_TIP = 30
UPPER_LIP_TOP = 51
EYES = slice(36, 48)
FEATHER = 0.035  # Gaussian sigma as a fraction of the crop size


def to_box_space(points: np.ndarray, box: np.ndarray, size: int = CROP_SIZE) -> np.ndarray:
    """[68, 2] frame coordinates -> coordinates in the box resized to size x size."""
    x1, y1, x2, y2 = (float(v) for v in box)
    scale = np.array([size / max(x2 - x1, 1.0), size / max(y2 - y1, 1.0)], dtype=np.float32)
    return (points - np.array([x1, y1], dtype=np.float32)) * scale


def lower_face_mask(points: np.ndarray, box: np.ndarray, size: int = CROP_SIZE) -> np.ndarray:
    """[size, size] uint8 alpha (255 = generated face) for one frame."""
    p = to_box_space(points, box, size)
    sigma = FEATHER * size
    # The jaw hull, shrunk by 2 sigma and blurred: full strength inside, ~0 at the jaw line.
    hull = cv2.convexHull(np.round(p[JAW] * 4).astype(np.int32))  # 2 bits of sub-pixel precision
    region = np.zeros((size, size), np.float32)
    cv2.fillConvexPoly(region, hull, 1.0, lineType=cv2.LINE_AA, shift=2)
    inset = max(1, int(round(2 * sigma)))
    region = cv2.erode(region, cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * inset + 1, 2 * inset + 1)))
    alpha = cv2.GaussianBlur(region, (0, 0), sigmaX=sigma, sigmaY=sigma, borderType=cv2.BORDER_CONSTANT)
    # A vertical ramp: 0 at the nose tip, full strength by the top of the upper lip (upstream's
    # parsing mask also starts about mid-face, at half the expanded crop box).
    start, lip = p[NOSE_TIP, 1], p[UPPER_LIP_TOP, 1]
    end = max(start + 1.0, lip)
    ramp = np.clip((np.arange(size, dtype=np.float32) - start) / (end - start), 0, 1)
    alpha *= (ramp * ramp * (3 - 2 * ramp))[:, None]  # smoothstep
    eyes_bottom = int(np.ceil(p[EYES, 1].max())) + 1
    alpha[: max(0, min(size, eyes_bottom)), :] = 0  # a hard guarantee: nothing at or above the eyes
    alpha[[0, -1], :] = 0
    alpha[:, [0, -1]] = 0
    return np.round(alpha * 255).astype(np.uint8)
