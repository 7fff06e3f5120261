"""The crop box from 68 landmarks: MuseTalk v1.5's rule, bit for bit, on sub-pixel landmarks."""

from __future__ import annotations

import numpy as np
import pytest

from lipstream.avatar.boxes import TEMPLATE_LANDMARKS, face_boxes, template_landmarks

W, H = 640, 360


def upstream_box(landmarks: np.ndarray, height: int, bbox_shift: int = 0, extra_margin: int = 10) -> list[int] | None:
    """One frame the way MuseTalk v1.5 does it (preprocessing.get_landmark_and_bbox, then the
    inference script's y2 + extra_margin clipped to the frame height), re-written here.
    None where upstream gives up on the landmark box and takes the face detector's instead."""
    pts = landmarks.astype(np.int32)  # truncation toward zero
    nose = pts[29]  # a view: the shift below moves landmark 29 itself
    if bbox_shift != 0:
        nose[1] = nose[1] + bbox_shift
    bottom = pts[:, 1].max()
    top = max(0, nose[1] - (bottom - nose[1]))
    x1, y1, x2, y2 = int(pts[:, 0].min()), int(top), int(pts[:, 0].max()), int(bottom)
    if x1 < 0 or x2 - x1 <= 0 or y2 - y1 <= 0:
        return None
    return [x1, y1, x2, min(y2 + extra_margin, height)]


def random_faces(n: int, seed: int) -> np.ndarray:
    """[n, 68, 2] sub-pixel face-like landmark sets inside a W x H frame, some close to its bottom."""
    rng = np.random.default_rng(seed)
    t = TEMPLATE_LANDMARKS - TEMPLATE_LANDMARKS.min(axis=0)  # 0 .. ~93 x 0 .. ~91
    scale = rng.uniform(0.8, 2.5, size=(n, 1, 1))
    size = t.max(axis=0) * scale[:, 0]
    origin = rng.uniform(0, 1, size=(n, 2)) * ([W, H] - size)
    origin[: n // 4, 1] = H - size[: n // 4, 1] - rng.uniform(0, 8, size=n // 4)  # chin near the bottom edge
    jitter = rng.uniform(-1.5, 1.5, size=(n, 68, 2))
    lm = origin[:, None] + t[None] * scale + jitter
    return np.clip(lm, 0.01, [W - 0.01, H - 0.01]).astype(np.float32)


@pytest.mark.parametrize("bbox_shift", [0, -7, 5, 30])
def test_equals_upstream_on_sub_pixel_landmarks(bbox_shift):
    lm = random_faces(400, seed=11 + bbox_shift)
    got = face_boxes(lm, W, H, bbox_shift=bbox_shift)
    want = [upstream_box(f, H, bbox_shift) for f in lm]
    assert all(b is not None for b in want)  # upstream keeps every landmark box
    want = np.array(want, dtype=np.int32)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)
    assert (want[:, 3] == H).any()  # the margin's clip to the frame is exercised


def test_shift_past_the_chin_gives_an_empty_box():
    """Upstream shifts landmark 29 in place before taking the lowest y: shifted to or past the chin it is
    the bottom itself, the box is empty and upstream takes the detector's box. LipStream's box is then
    only the margin tall (compile refuses it as too small); the old rule gave an upside-down box."""
    lm = TEMPLATE_LANDMARKS.copy()  # landmark 29 at y 119, lowest y 178
    lm[:, 1] += 0.7
    assert upstream_box(lm, 1000, bbox_shift=59) is None and upstream_box(lm, 1000, bbox_shift=80) is None
    assert upstream_box(lm, 1000, bbox_shift=58) is not None
    assert face_boxes(lm[None], 1000, 1000, bbox_shift=58)[0].tolist() == [179, 176, 272, 188]
    assert face_boxes(lm[None], 1000, 1000, bbox_shift=80)[0].tolist() == [179, 199, 272, 209]


def test_truncates_where_rounding_would_differ():
    """Landmarks at x.6 (and landmark 29 at y.6): truncation and rounding give boxes up to 2 px apart."""
    lm = TEMPLATE_LANDMARKS.copy()  # integer points: x 179 .. 272, landmark 29 at y 119, lowest y 178
    lm[:, 0] += 0.6
    lm[:, 1] += 0.4
    lm[29, 1] = 119.6
    box = face_boxes(lm[None], 1000, 1000)[0].tolist()
    assert box == [179, 60, 272, 188] == upstream_box(lm, 1000)  # y1 = 2 * 119 - 178; y2 = 178 + 10
    r = np.round(lm)  # what rounding gives instead: [180, 62, 273, 188]
    rounded = [r[:, 0].min(), 2 * r[29, 1] - r[:, 1].max(), r[:, 0].max(), r[:, 1].max() + 10]
    assert rounded == [180, 62, 273, 188] != box


def test_truncation_is_toward_zero():
    lm = TEMPLATE_LANDMARKS.copy()
    lm[0, 0] = -0.9  # astype(int32) gives 0 (floor would give -1, which upstream would refuse)
    assert face_boxes(lm[None], 1000, 1000)[0, 0] == 0 == upstream_box(lm, 1000)[0]


def test_clipped_to_the_frame():
    """Where upstream would fall back to the detector's box (x1 < 0), LipStream clips the landmark box."""
    lm = TEMPLATE_LANDMARKS.copy()
    lm[:, 0] -= 200  # x -21 .. 72
    lm[:, 1] += 150  # lowest y 328: + 10 margin runs past a 330 px frame
    x1, y1, x2, y2 = face_boxes(lm[None], 70, 330)[0].tolist()
    assert (x1, x2, y2) == (0, 70, 330) and y1 == 2 * 269 - 328


def test_template_landmarks_round_trip():
    rng = np.random.default_rng(3)
    x1, y1 = rng.integers(0, 400, 200), rng.integers(0, 200, 200)
    w, h = rng.integers(48, 200, 200), rng.integers(48, 150, 200)
    boxes = np.stack([x1, y1, x1 + w, y1 + h], axis=1)
    back = face_boxes(template_landmarks(boxes), 10**6, 10**6, extra_margin=0)
    even = h % 2 == 0
    np.testing.assert_array_equal(back[even], boxes[even])
    # the rule only makes even heights: an odd one comes back 1 px taller, at the top
    np.testing.assert_array_equal(back[~even], boxes[~even] - [0, 1, 0, 0])
    assert face_boxes(template_landmarks(np.array([[250, 100, 360, 230]])), W, H).tolist() == [[250, 100, 360, 240]]


MUSETALK_REFERENCE = "LIPSTREAM_MUSETALK_REFERENCE"  # a MuseTalk checkout (github.com/TMElyralab/MuseTalk)


def upstream_preprocessing():
    """MuseTalk's musetalk/utils/preprocessing.py run as a module, its networks replaced by stand-ins that hand
    it given landmarks: `feed(landmarks [N, 68, 2], detected [N] bool)` before each call. None without the file."""
    import os
    import sys
    import types
    from pathlib import Path

    root = os.environ.get(MUSETALK_REFERENCE)
    path = Path(root) / "musetalk" / "utils" / "preprocessing.py" if root else None
    if path is None or not path.is_file():
        return None
    queue: list = []

    def inference_topdown(model, frame):
        points = np.zeros((1, 133, 2), np.float32)
        points[0, 23:91] = queue[0][0]
        return [types.SimpleNamespace(pred_instances=types.SimpleNamespace(keypoints=points))]

    class FaceAlignment:
        def __init__(self, *args, **kwargs):
            pass

        def get_detections_for_batch(self, frames):
            _, found = queue.pop(0)
            return [(0, 0, 8, 8) if found else None]  # upstream's fallback box, where it takes it

    stand_ins = {"face_detection": {"FaceAlignment": FaceAlignment, "LandmarksType": types.SimpleNamespace(_2D=0)},
                 "mmpose": {}, "mmpose.apis": {"inference_topdown": inference_topdown, "init_model": lambda *a, **k: None},
                 "mmpose.structures": {"merge_data_samples": lambda results: results[0]}}
    saved = {name: sys.modules.get(name) for name in stand_ins}
    try:
        for name, attrs in stand_ins.items():
            sys.modules[name] = types.SimpleNamespace(**attrs)
        module = types.ModuleType("musetalk_preprocessing")
        exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    finally:
        for name, old in saved.items():
            if old is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
    module.read_imgs = lambda img_list: [np.zeros((H, W, 3), np.uint8) for _ in img_list]
    module.print = lambda *a, **k: None

    def feed(landmarks, detected):
        queue[:] = list(zip(landmarks, detected))
    return module, feed


@pytest.mark.parametrize("bbox_shift", [0, -7, 5, 30])
def test_equals_upstream_get_landmark_and_bbox_itself(bbox_shift):
    """Upstream's own function (its face detector and DWPose replaced by the landmarks given): LipStream's box
    without the margin is its box wherever it keeps the landmark box. Skips without $LIPSTREAM_MUSETALK_REFERENCE."""
    reference = upstream_preprocessing()
    if reference is None:
        pytest.skip(f"${MUSETALK_REFERENCE} names no MuseTalk checkout")
    module, feed = reference
    lm = random_faces(200, seed=3 + abs(bbox_shift))
    feed(lm, [True] * len(lm))
    coords, _ = module.get_landmark_and_bbox([f"{i}.png" for i in range(len(lm))], bbox_shift)
    got = face_boxes(lm, W, H, bbox_shift=bbox_shift, extra_margin=0)
    kept = [c != (0, 0, 8, 8) for c in coords]
    assert sum(kept) > 150, sum(kept)
    np.testing.assert_array_equal(got[kept], np.array([c for c, k in zip(coords, kept) if k], dtype=np.int64))
    # a frame where upstream's detector finds no face is its placeholder; LipStream fills it from its neighbours
    feed(lm[:3], [True, False, True])
    coords, _ = module.get_landmark_and_bbox(["0.png", "1.png", "2.png"], bbox_shift)
    assert coords[1] == module.coord_placeholder
