"""MuseTalk v1.5's crop box from 68 landmarks, and a landmark template for box-only tracks."""

from __future__ import annotations

import numpy as np

NOSE_BRIDGE = 29  # iBUG index the box's vertical centre is anchored on
EXTRA_MARGIN = 10  # v1.5 extends the box below the chin by this many pixels
MIN_FACE = 48  # pixels: a smaller box would be upscaled 5x into the 256 crop


def face_boxes(landmarks: np.ndarray, width: int, height: int, *, extra_margin: int = EXTRA_MARGIN,
               bbox_shift: int = 0) -> np.ndarray:
    """[N, 68, 2] landmarks -> [N, 4] int32 boxes (x1, y1, x2, y2), exclusive ends, inside the frame.

    Upstream's rule (musetalk/utils/preprocessing.py, get_landmark_and_bbox), step for step:
    - the landmarks are truncated to integers (`astype(np.int32)`: toward zero, not rounded);
    - landmark 29's y is moved down by `bbox_shift`, in place, and the lowest landmark is taken
      after the shift: shifted to or past the chin, landmark 29 is the bottom and the box is empty;
    - x1 = min x, x2 = max x, y2 = max y, and the top mirrors the bottom about landmark 29:
      y1 = max(0, y29 - (y2 - y29));
    - v1.5's inference then adds `extra_margin` below: y2 = min(y2 + extra_margin, height).
    Where upstream gives up on that box (x1 < 0, or an empty box) it falls back to the face
    detector's box. LipStream has none: it keeps the landmark box clipped to the frame (x to
    [0, width], y to [0, height]), and compile refuses a box smaller than MIN_FACE a side (an empty
    box is only `extra_margin` px tall after the margin, so with the default margin it is refused).
    Inside the frame, that clipping changes nothing: the boxes are upstream's bit for bit.
    """
    pts = np.asarray(landmarks).astype(np.int32).astype(np.int64)  # upstream: face_land_mark.astype(np.int32)
    xs, ys = pts[..., 0], pts[..., 1].copy()
    ys[:, NOSE_BRIDGE] = (ys[:, NOSE_BRIDGE] + bbox_shift).astype(np.int64)  # half_face_coord[1] += shift, in place
    x1 = xs.min(axis=1)
    x2 = xs.max(axis=1)
    y2 = ys.max(axis=1)  # after the shift, as upstream
    half = ys[:, NOSE_BRIDGE]
    y1 = np.maximum(0, half - (y2 - half))
    y2 = y2 + extra_margin
    boxes = np.stack([x1, y1, x2, y2], axis=1)
    boxes[:, [0, 2]] = boxes[:, [0, 2]].clip(0, width)
    boxes[:, [1, 3]] = boxes[:, [1, 3]].clip(0, height)
    return boxes.astype(np.int32)


def box_sizes(boxes: np.ndarray) -> np.ndarray:
    return np.stack([boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]], axis=1)


# Mean frontal face in box-relative coordinates (0..1), for tracks that give boxes only: the
# astronaut photo's 68 points normalised to its MuseTalk box.
TEMPLATE_LANDMARKS = np.array([
    [179, 104], [180, 116], [181, 127], [182, 139], [185, 150], [191, 160], [200, 168], [209, 176], [220, 178],
    [232, 177], [243, 171], [253, 163], [260, 154], [265, 143], [268, 131], [270, 120], [272, 108], [186, 94],
    [192, 88], [200, 87], [208, 89], [216, 92], [236, 93], [244, 91], [252, 91], [260, 92], [265, 99], [226, 102],
    [225, 111], [225, 119], [225, 127], [214, 131], [219, 133], [224, 134], [229, 133], [234, 132], [195, 101],
    [200, 98], [207, 98], [212, 104], [206, 104], [199, 104], [237, 106], [243, 100], [250, 100], [255, 105],
    [250, 107], [244, 107], [201, 139], [209, 139], [218, 139], [224, 141], [230, 140], [238, 140], [246, 141],
    [238, 151], [229, 155], [222, 156], [216, 155], [208, 150], [204, 141], [218, 143], [223, 144], [230, 143],
    [243, 142], [229, 150], [223, 151], [217, 150]], dtype=np.float32)


def template_landmarks(boxes: np.ndarray) -> np.ndarray:
    """[N, 4] MuseTalk boxes (without the v1.5 margin) -> [N, 68, 2] plausible landmarks inside them.

    face_boxes(template_landmarks(b), ..., extra_margin=0) gives b back: the extreme landmarks land
    exactly on the box's edges and landmark 29 exactly half way down. The rule only makes boxes of
    even height (y1 mirrors y2 about landmark 29), so an odd height comes back 1 px taller.
    """
    t = TEMPLATE_LANDMARKS
    tb = face_boxes(t[None], 10**6, 10**6, extra_margin=0)[0].astype(np.float32)
    rel = (t - tb[:2]) / (tb[2:] - tb[:2])
    b = boxes.astype(np.float32)
    return (b[:, None, :2] + rel[None] * (b[:, None, 2:] - b[:, None, :2])).astype(np.float32)
