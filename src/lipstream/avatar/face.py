"""Face tracking: 68-point iBUG landmarks per frame, behind a small backend interface.

The tracker detects a face on a downscaled frame only now and then; in between, each frame's
landmarks are fitted inside a box derived from the previous frame's (2-3 ms with dlib), and the
fit is confirmed by running the detector on a small crop around it (~1-2 ms), which keeps
tracking cheap and stable and still notices a frame without a face. Misses are filled from the neighbouring frames, and the
landmark tracks are smoothed over time so a still head gives a still box.

Detections are chosen by score, not size: JPEG blocking gives weak false positives (dlib scores
~0.01-0.15 on the folds of the astronaut's suit, against ~1.4 for her face) that may well be larger
than the face. A detection that agrees with the track is preferred, then the track's own
fit, then a new face, which must also score clearly on the confirming crop, where it is seen at
the detector's best scale.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple, Protocol

import cv2
import numpy as np

from lipstream.errors import require

Box = tuple[float, float, float, float]  # x1, y1, x2, y2
DETECT_WIDTH = 640  # detection runs on frames scaled down to this width
REDETECT_EVERY = 25  # frames between full detections while tracking holds
AGREE_IOU = 0.4  # a detection overlapping the tracked box this much is the same face
CONFIRM_IOU = 0.5  # the confirming detection must overlap the fitted box this much
MAX_TRIES = 3  # detections fitted and confirmed per frame, at most (a cluttered frame has many)


class Detection(NamedTuple):
    box: Box
    score: float  # the backend's confidence: higher is surer; compared only within one backend


class FaceBackend(Protocol):
    """What the tracker needs from a face model (dlib today; mediapipe or DWPose later)."""

    name: str
    new_face_score: float  # the least score, on a crop with the face ~100 px, that starts a new track

    def detect(self, gray: np.ndarray) -> list[Detection]:
        """Every candidate face in a grey image with its score, most confident first.

        Weak candidates belong in the list too: the tracker weighs them by score and by agreement
        with the track, and confirms them on a crop, so the backend need not decide alone.
        """

    def landmarks(self, gray: np.ndarray, box: Box) -> np.ndarray:
        """[68, 2] iBUG landmarks of the face in `box`."""


class DlibBackend:
    """dlib's HOG detector + 68-point shape predictor, from the dlib-bin and face-recognition-models wheels."""

    name = "dlib-68"
    # dlib's HOG scores are SVM margins past its own threshold. On the confirming crop a real face
    # scores ~0.9-1.6 (the astronaut moving, rolled, noisy, small, JPEG, H.264 at crf 35); the false
    # positives that JPEG blocking gives on her suit score 0.07 at most there, when found at all.
    new_face_score = 0.15

    def __init__(self) -> None:
        require("dlib", "face tracking", otherwise="pass --track FILE with precomputed landmarks or boxes")
        import dlib

        spec = importlib.util.find_spec("face_recognition_models")  # its __init__ needs pkg_resources: don't import
        model = Path(spec.submodule_search_locations[0]) / "models" / "shape_predictor_68_face_landmarks.dat"
        self._dlib = dlib
        self._detector = dlib.get_frontal_face_detector()
        self._predictor = dlib.shape_predictor(str(model))

    def detect(self, gray: np.ndarray) -> list[Detection]:
        rects, scores, _ = self._detector.run(gray, 0, 0.0)  # threshold 0: every candidate dlib has
        order = np.argsort(scores, kind="stable")[::-1]
        return [Detection((rects[i].left(), rects[i].top(), rects[i].right(), rects[i].bottom()), float(scores[i]))
                for i in order]

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


def _candidates(backend: FaceBackend, gray: np.ndarray, near: Box | None) -> list[tuple[Box, bool]]:
    """Detected boxes in the order to try them, each with whether it agrees with the track at `near`.

    Those that agree with the track come first (the same person), then the rest; each group best
    score first. Score, not size: a weak false positive can be larger than the face.
    """
    scale = min(1.0, DETECT_WIDTH / gray.shape[1])
    small = cv2.resize(gray, None, fx=scale, fy=scale, interpolation=cv2.INTER_AREA) if scale < 1 else gray
    found = sorted((Detection(tuple(v / scale for v in d.box), d.score) for d in backend.detect(small)),
                   key=lambda d: d.score, reverse=True)
    agrees = [near is not None and _iou(d.box, near) >= AGREE_IOU for d in found]
    return ([(d.box, True) for d, a in zip(found, agrees) if a] +
            [(d.box, False) for d, a in zip(found, agrees) if not a])


def _face_present(backend: FaceBackend, gray: np.ndarray, points: np.ndarray, min_score: float = 0.0) -> bool:
    """Is there really a face where the fitted landmarks say? (A shape model always returns a shape.)

    Runs the detector on a small crop around the fit, scaled so the face is ~100 px (~1-2 ms), and
    asks for a detection that overlaps the fit and scores at least `min_score`.
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
    fit = ((x1 - cx1) * scale, (y1 - cy1) * scale, (x2 - cx1) * scale, (y2 - cy1) * scale)
    return any(d.score >= min_score and _iou(d.box, fit) >= CONFIRM_IOU for d in backend.detect(crop))


def _follow(backend: FaceBackend, gray: np.ndarray, previous: np.ndarray) -> np.ndarray | None:
    """Landmarks fitted in the box of the previous frame's, if the fit is plausible and confirmed."""
    points = backend.landmarks(gray, box_from_landmarks(previous))
    return points if _plausible(points, previous) and _face_present(backend, gray, points) else None


def _find(backend: FaceBackend, gray: np.ndarray, previous: np.ndarray | None, follow: bool) -> np.ndarray | None:
    """Landmarks from a full detection: the tracked face if it is still there, else a new face."""
    candidates = _candidates(backend, gray, box_from_landmarks(previous) if previous is not None else None)
    agreeing = [box for box, agrees in candidates if agrees]
    new = [box for box, agrees in candidates if not agrees]
    for box in agreeing[:MAX_TRIES]:
        points = backend.landmarks(gray, box)
        if _face_present(backend, gray, points):
            return points
    if follow and previous is not None:  # the detector missed it; the fitted track may still hold
        points = _follow(backend, gray, previous)
        if points is not None:
            return points
    for box in new[:MAX_TRIES]:
        points = backend.landmarks(gray, box)
        if _face_present(backend, gray, points, backend.new_face_score):
            return points
    return None


def track(luma: Callable[[int], np.ndarray], frames: int, backend: FaceBackend,
          progress: Callable[[int], None] | None = None) -> np.ndarray:
    """[frames, 68, 2] float32 landmarks, NaN where no face was found."""
    out = np.full((frames, 68, 2), np.nan, dtype=np.float32)
    previous: np.ndarray | None = None
    for i in range(frames):
        gray = luma(i)
        points = None
        followed = previous is not None and i % REDETECT_EVERY != 0
        if followed:
            points = _follow(backend, gray, previous)
        if points is None:
            points = _find(backend, gray, previous, follow=not followed)
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
