"""Face tracking: 68-point iBUG landmarks per frame, behind a small backend interface.

The tracker detects a face on a downscaled frame only now and then; in between, each frame's
landmarks are fitted inside a box derived from the previous frame's (2-3 ms with dlib), and the
fit is confirmed by running the detector on a small crop around it (~1-2 ms), which keeps
tracking cheap and stable and still notices a frame without a face. Misses are filled from the neighbouring frames, and the
landmark tracks are smoothed over time so a still head gives a still box.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import cv2
import numpy as np

from lipstream.errors import LipStreamError

Box = tuple[float, float, float, float]  # x1, y1, x2, y2
DETECT_WIDTH = 640  # detection runs on frames scaled down to this width
REDETECT_EVERY = 25  # frames between full detections while tracking holds


class FaceBackend(Protocol):
    """What the tracker needs from a face model (dlib today; mediapipe or DWPose later)."""

    name: str

    def detect(self, gray: np.ndarray) -> list[Box]:
        """Face boxes in a grey image, most confident first."""

    def landmarks(self, gray: np.ndarray, box: Box) -> np.ndarray:
        """[68, 2] iBUG landmarks of the face in `box`."""


class DlibBackend:
    """dlib's HOG detector + 68-point shape predictor, from the dlib-bin and face-recognition-models wheels."""

    name = "dlib-68"

    def __init__(self) -> None:
        try:
            import dlib
        except ImportError:
            raise LipStreamError("face tracking needs dlib: pip install dlib-bin face-recognition-models "
                                 "(or pass --track FILE with precomputed boxes or landmarks)") from None
        spec = importlib.util.find_spec("face_recognition_models")  # its __init__ needs pkg_resources: don't import
        if spec is None or not spec.submodule_search_locations:
            raise LipStreamError("face tracking needs the 68-point model: pip install face-recognition-models "
                                 "(or pass --track FILE)")
        model = Path(spec.submodule_search_locations[0]) / "models" / "shape_predictor_68_face_landmarks.dat"
        self._dlib = dlib
        self._detector = dlib.get_frontal_face_detector()
        self._predictor = dlib.shape_predictor(str(model))

    def detect(self, gray: np.ndarray) -> list[Box]:
        rects, scores, _ = self._detector.run(gray, 0, 0.0)
        order = np.argsort(scores)[::-1]
        return [(rects[i].left(), rects[i].top(), rects[i].right(), rects[i].bottom()) for i in order]

    def landmarks(self, gray: np.ndarray, box: Box) -> np.ndarray:
        rect = self._dlib.rectangle(*(int(round(v)) for v in box))
        shape = self._predictor(gray, rect)
        return np.array([(p.x, p.y) for p in shape.parts()], dtype=np.float32)


def box_from_landmarks(points: np.ndarray) -> Box:
    """The detector-style square box that frames these landmarks (used to re-fit the next frame)."""
    x1, y1 = points.min(axis=0)
    x2, y2 = points.max(axis=0)
    side = 0.97 * (x2 - x1)
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2 - 0.04 * side
    return (cx - side / 2, cy - side / 2, cx + side / 2, cy + side / 2)


def _plausible(points: np.ndarray, previous: np.ndarray) -> bool:
    size = np.ptp(points, axis=0).mean()
    before = np.ptp(previous, axis=0).mean()
    shift = np.linalg.norm(points.mean(axis=0) - previous.mean(axis=0))
    return 0.75 < size / max(before, 1e-6) < 1.33 and shift < 0.35 * before


def _iou(a: Box, b: Box) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _detect(backend: FaceBackend, gray: np.ndarray, near: Box | None) -> Box | None:
    scale = min(1.0, DETECT_WIDTH / gray.shape[1])
    small = cv2.resize(gray, None, fx=scale, fy=scale, interpolation=cv2.INTER_AREA) if scale < 1 else gray
    boxes = [tuple(v / scale for v in b) for b in backend.detect(small)]
    if not boxes:
        return None
    if near is not None:  # keep following the same person
        return max(boxes, key=lambda b: _iou(b, near))
    return max(boxes, key=lambda b: (b[2] - b[0]) * (b[3] - b[1]))  # the presenter: the largest face


def _face_present(backend: FaceBackend, gray: np.ndarray, points: np.ndarray) -> bool:
    """Is there really a face where the fitted landmarks say? (A shape model always returns a shape.)

    Runs the detector on a small crop around the fit, scaled so the face is ~100 px: ~1-2 ms.
    """
    x1, y1, x2, y2 = box_from_landmarks(points)
    side = max(x2 - x1, 1.0)
    pad = 0.45 * side
    h, w = gray.shape
    cx1, cy1 = int(max(0, x1 - pad)), int(max(0, y1 - pad))
    cx2, cy2 = int(min(w, x2 + pad)), int(min(h, y2 + pad))
    if cx2 - cx1 < 8 or cy2 - cy1 < 8:
        return False
    scale = 100.0 / side
    crop = cv2.resize(gray[cy1:cy2, cx1:cx2], None, fx=scale, fy=scale,
                      interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR)
    return bool(backend.detect(crop))


def track(luma: Callable[[int], np.ndarray], frames: int, backend: FaceBackend,
          progress: Callable[[int], None] | None = None) -> np.ndarray:
    """[frames, 68, 2] float32 landmarks, NaN where no face was found."""
    out = np.full((frames, 68, 2), np.nan, dtype=np.float32)
    previous: np.ndarray | None = None
    for i in range(frames):
        gray = luma(i)
        points = None
        if previous is not None and i % REDETECT_EVERY:
            candidate = backend.landmarks(gray, box_from_landmarks(previous))
            points = candidate if _plausible(candidate, previous) else None
        if points is None:
            box = _detect(backend, gray, box_from_landmarks(previous) if previous is not None else None)
            if box is not None:
                points = backend.landmarks(gray, box)
            elif previous is not None:  # detector lost it; the fitted track may still hold
                candidate = backend.landmarks(gray, box_from_landmarks(previous))
                points = candidate if _plausible(candidate, previous) else None
        if points is not None and not _face_present(backend, gray, points):
            points = None
        if points is not None:
            out[i] = points
        previous = points
        if progress:
            progress(1)
    return out


def fill_gaps(landmarks: np.ndarray) -> np.ndarray:
    """Frames without a face take their landmarks from the neighbours (linear in time, held at the ends)."""
    found = ~np.isnan(landmarks).any(axis=(1, 2))
    if not found.any():
        raise ValueError("no face in any frame")
    if found.all():
        return landmarks
    t = np.arange(len(landmarks))
    flat = landmarks.reshape(len(landmarks), -1)
    filled = np.stack([np.interp(t, t[found], flat[found, k]) for k in range(flat.shape[1])], axis=1)
    return filled.reshape(landmarks.shape).astype(np.float32)


def smooth(landmarks: np.ndarray, sigma: float = 1.5) -> np.ndarray:
    """Zero-phase Gaussian smoothing over time; the ends reflect, as the loop plays ping-pong."""
    n = len(landmarks)
    if n < 3 or sigma <= 0:
        return landmarks
    radius = max(1, int(3 * sigma))
    kernel = np.exp(-0.5 * (np.arange(-radius, radius + 1) / sigma) ** 2)
    kernel /= kernel.sum()
    padded = np.pad(landmarks, ((radius, radius), (0, 0), (0, 0)), mode="reflect" if n > radius else "edge")
    out = np.zeros_like(landmarks, dtype=np.float64)
    for k, w in enumerate(kernel):
        out += w * padded[k:k + n]
    return out.astype(np.float32)
