"""Face finding on awkward inputs (JPEG stills and videos, clutter) and no leftovers from a failed compile."""

from __future__ import annotations

import json
from pathlib import Path

import av
import cv2
import numpy as np
import pytest

from lipstream.avatar import compile_avatar, compile_many, load_avatar
from lipstream.avatar.face import DlibBackend, Detection, _candidates
from lipstream.avatar.trackers import DlibTracker
from lipstream.cli import main
from lipstream.errors import InputError
from lipstream.fixtures.avatar import ASTRONAUT_POINTS, FACE_CENTER, astronaut_photo, render_frame, still_image

pytestmark = pytest.mark.face_model  # dlib's 68-point model tracks the faces here


# scikit-image's brick wall (skimage.data.brick(), from CC0Textures, CC0), pixel for pixel
BRICK = Path(__file__).parent / "data" / "brick.png"


# The astronaut's face in the 512x512 photo (x1, y1, x2, y2): a PNG compile's landmarks span
# x 179-272, y 87-178; her suit, where JPEG blocking makes dlib see weak "faces", is below y 300.
FACE_REGION = (150, 60, 290, 230)
TRUTH = ("nose_tip", "lips_center", "chin")


@pytest.fixture(scope="module")
def backend():
    return DlibBackend()


def _compile(path, out, tiny_models, backend, **kwargs):
    return compile_avatar(path, out, tiny_models.vae, tiny_models.fingerprints["vae"], tracker=DlibTracker(backend),
                          progress=False, **kwargs)


def _jpeg(rgb: np.ndarray, quality: int) -> np.ndarray:
    """RGB through a JPEG encode and decode at `quality` (OpenCV's libjpeg, 4:2:0)."""
    ok, data = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    assert ok
    return cv2.cvtColor(cv2.imdecode(data, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)


def _on_the_face(landmarks: np.ndarray, box: np.ndarray, transform: np.ndarray | None = None) -> None:
    """Landmarks inside the face region of the photo, and the box around nose, lips and chin."""
    m = np.eye(3)[:2] if transform is None else transform
    inverse = cv2.invertAffineTransform(m)
    photo_points = landmarks @ inverse[:, :2].T + inverse[:, 2]
    x1, y1, x2, y2 = FACE_REGION
    assert (photo_points[:, 0] > x1).all() and (photo_points[:, 0] < x2).all(), photo_points.min(0)
    assert (photo_points[:, 1] > y1).all() and (photo_points[:, 1] < y2).all(), photo_points.max(0)
    for name in TRUTH:
        x, y = m @ np.array([*ASTRONAUT_POINTS[name], 1.0])
        assert box[0] <= x < box[2] and box[1] <= y < box[3], (name, box.tolist())


# ---- item 6: choose the face by detector score, not by size ----

def test_candidates_by_score_and_agreement_with_the_track():
    class Stub:
        name, new_face_score = "stub", 0.1

        def detect(self, gray):
            return [Detection((300, 300, 500, 500), 0.02), Detection((10, 10, 110, 110), 1.5),
                    Detection((200, 20, 300, 120), 0.6)]

    gray = np.zeros((600, 600), np.uint8)
    assert _candidates(Stub(), gray, None) == [((10, 10, 110, 110), False), ((200, 20, 300, 120), False),
                                               ((300, 300, 500, 500), False)]
    assert _candidates(Stub(), gray, (205, 25, 305, 125))[0] == ((200, 20, 300, 120), True)
    assert _candidates(Stub(), gray, (205, 25, 305, 125))[1:] == [((10, 10, 110, 110), False),
                                                                  ((300, 300, 500, 500), False)]


@pytest.mark.parametrize("quality", [85, 90, 95])
def test_jpeg_portrait_finds_the_face(tmp_path, tiny_models, backend, quality):
    """The astronaut as a JPEG: dlib also 'finds' a weak face in her suit (score ~0.01-0.05), at
    quality 85 and 95 a larger one than hers (score ~1.4)."""
    path = tmp_path / f"astronaut_q{quality}.jpg"
    assert cv2.imwrite(str(path), cv2.cvtColor(astronaut_photo(), cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, quality])
    result = _compile(path, tmp_path / "avatars", tiny_models, backend)
    assert result.status == "compiled" and result.message == ""
    avatar = load_avatar(result.path, with_frames=False)
    _on_the_face(avatar.landmarks.numpy()[0], avatar.boxes.numpy()[0])


def _cluttered_wall(width: int, height: int, seed: int) -> np.ndarray:
    """RGB: a brick wall with posters, stickers and cables (rectangles, ellipses, lines) and camera noise."""
    rng = np.random.default_rng(seed)
    wall = cv2.resize(cv2.imread(str(BRICK), cv2.IMREAD_GRAYSCALE), (width, height)).astype(np.float32)
    rgb = np.stack([wall * 0.8, wall * 0.9, wall], axis=2).astype(np.uint8)
    for _ in range(40):
        x, y = int(rng.integers(0, width)), int(rng.integers(0, height))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        kind = rng.integers(3)
        if kind == 0:
            cv2.rectangle(rgb, (x, y), (x + int(rng.integers(10, 90)), y + int(rng.integers(10, 90))), colour,
                          -1 if rng.random() < 0.5 else 3)
        elif kind == 1:
            cv2.ellipse(rgb, (x, y), (int(rng.integers(5, 50)), int(rng.integers(5, 50))), float(rng.uniform(0, 180)),
                        0, 360, colour, -1)
        else:
            cv2.line(rgb, (x, y), (int(rng.integers(0, width)), int(rng.integers(0, height))), colour,
                     int(rng.integers(1, 6)))
    return np.clip(rgb + rng.normal(0, 3, rgb.shape), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("suffix,quality", [("png", None), ("jpg", 80), ("jpg", 85)])
def test_cluttered_still_finds_the_face(tmp_path, tiny_models, backend, suffix, quality):
    """The photo pasted onto a busy wall, 640x640 (detected at full size); as JPEG, the suit again
    gives a weak false positive larger than the face."""
    rgb = _cluttered_wall(640, 640, seed=1)
    ox, oy = 0, 128
    rgb[oy:oy + 512, ox:ox + 512] = astronaut_photo()
    path = tmp_path / f"cluttered.{suffix}"
    assert cv2.imwrite(str(path), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR),
                       [cv2.IMWRITE_JPEG_QUALITY, quality] if quality else [])
    result = _compile(path, tmp_path / "avatars", tiny_models, backend)
    assert result.status == "compiled" and result.message == ""
    avatar = load_avatar(result.path, with_frames=False)
    _on_the_face(avatar.landmarks.numpy()[0], avatar.boxes.numpy()[0], np.array([[1.0, 0, ox], [0, 1.0, oy]]))


def _moving_photo(frames: int, fps: int = 10) -> tuple[list[np.ndarray], np.ndarray]:
    """The 512x512 photo with a gentle sway and roll (suit in view); the per-frame transforms."""
    out, transforms, photo = [], [], astronaut_photo()
    for i in range(frames):
        t = 2 * np.pi * i / fps
        m = cv2.getRotationMatrix2D(FACE_CENTER, 2.0 * np.sin(0.3 * t), 1 + 0.02 * np.sin(0.4 * t))
        m[:, 2] += (6 * np.sin(0.23 * t), 4 * np.sin(0.31 * t))
        out.append(render_frame(photo, m, 512, 512))
        transforms.append(m)
    return out, np.stack(transforms)


def _write(path, frames: list[np.ndarray], codec: str, options: dict, pix_fmt: str, fps: int = 10) -> None:
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps, options=options)
        stream.width, stream.height, stream.pix_fmt = 512, 512, pix_fmt
        for rgb in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)


@pytest.mark.parametrize("kind", ["jpeg-frames", "mjpeg"])
def test_jpeg_video_tracks_the_face_in_every_frame(tmp_path, tiny_models, backend, kind):
    frames, transforms = _moving_photo(12)
    if kind == "jpeg-frames":  # stills from a camera's JPEGs, put together losslessly
        path = tmp_path / "jpeg_frames.mp4"
        _write(path, [_jpeg(f, 85) for f in frames], "libx264", {"qp": "0", "preset": "ultrafast"}, "yuv420p")
    else:  # a webcam's Motion-JPEG
        path = tmp_path / "webcam.avi"
        _write(path, frames, "mjpeg", {"qmin": "4", "qmax": "4"}, "yuvj420p")
    result = _compile(path, tmp_path / "avatars", tiny_models, backend, force=True)
    assert result.status == "compiled" and result.frames == 12
    assert result.message == ""  # a face in every frame, none filled in from the neighbours
    avatar = load_avatar(result.path, with_frames=False)
    for i in range(12):
        _on_the_face(avatar.landmarks.numpy()[i], avatar.boxes.numpy()[i], transforms[i])


# ---- item 7: a failed compile leaves no folder behind ----

def _faceless(path) -> None:
    gradient = np.linspace(40, 90, 360, dtype=np.uint8)[:, None, None]
    assert cv2.imwrite(str(path), np.broadcast_to(gradient, (360, 640, 3)).copy())


def test_no_face_leaves_no_new_output_folders(tmp_path, tiny_models, backend):
    _faceless(tmp_path / "wall.png")
    with pytest.raises(InputError, match="no face found"):
        _compile(tmp_path / "wall.png", tmp_path / "out" / "avatars", tiny_models, backend)
    assert not (tmp_path / "out").exists()


def test_face_too_small_leaves_no_new_output_folders(tmp_path, tiny_models):
    still_image(tmp_path / "photo.png", width=640, height=360)
    tiny_box = tmp_path / "t.json"
    tiny_box.write_text(json.dumps({"boxes": [[300, 150, 330, 180]]}))
    with pytest.raises(InputError, match="face too small"):
        _compile(tmp_path / "photo.png", tmp_path / "out" / "avatars", tiny_models, None, track_file=tiny_box)
    assert not (tmp_path / "out").exists()


def test_existing_output_folder_is_kept(tmp_path, tiny_models, backend):
    _faceless(tmp_path / "wall.png")
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(InputError, match="no face found"):
        _compile(tmp_path / "wall.png", existing / "new" / "avatars", tiny_models, backend)
    assert existing.is_dir() and list(existing.iterdir()) == []
    with pytest.raises(InputError, match="no face found"):
        _compile(tmp_path / "wall.png", existing, tiny_models, backend)
    assert existing.is_dir() and list(existing.iterdir()) == []


def test_success_into_new_folders_and_failures_beside_it(tmp_path, tiny_models, backend):
    still_image(tmp_path / "photo.png", width=640, height=360)
    _faceless(tmp_path / "wall.png")
    out = tmp_path / "out" / "avatars"
    results = compile_many([tmp_path / "photo.png", tmp_path / "wall.png"], out, tiny_models.vae,
                           tiny_models.fingerprints["vae"], tracker=DlibTracker(backend), progress=False)
    assert [r.status for r in results] == ["compiled", "failed"]
    assert sorted(p.name for p in out.iterdir()) == ["photo"]  # the failure took nothing of the success
    assert load_avatar(out / "photo", with_frames=False).num_frames == 1


def test_compile_many_and_the_command_leave_no_new_output_folders(tmp_path, tiny_models, backend):
    _faceless(tmp_path / "wall.png")
    results = compile_many([tmp_path / "wall.png"], tmp_path / "out" / "avatars", tiny_models.vae,
                           tiny_models.fingerprints["vae"], tracker=DlibTracker(backend), progress=False)
    assert results[0].status == "failed" and "no face found" in results[0].message
    assert not (tmp_path / "out").exists()
    code = main(["compile", str(tmp_path / "wall.png"), "-o", str(tmp_path / "cli" / "avatars"),
                 "--random-weights", "--random-size", "tiny", "--device", "cpu", "--tracker", "dlib"])
    assert code == 1
    assert not (tmp_path / "cli").exists()
