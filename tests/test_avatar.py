"""Avatar compiler: real fixture videos in, caches out, checked against the fixture's ground truth."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from lipstream.avatar import CompileOptions, compile_avatar, compile_many, load_avatar, ping_pong
from lipstream.avatar import cache as cache_mod
from lipstream.avatar.boxes import face_boxes
from lipstream.avatar.compile import expand_inputs
from lipstream.avatar.face import DlibBackend, fill_gaps, smooth, track
from lipstream.avatar.trackers import DlibTracker
from lipstream.avatar.latents import encode_latents, face_crop
from lipstream.avatar.masks import to_box_space
from lipstream.avatar.video import LoopsAhead, read_loop
from lipstream.errors import InputError
from lipstream.fixtures.avatar import EYE_RADIUS, action_loop, still_image

pytestmark = pytest.mark.face_model  # dlib's 68-point model tracks the faces here

W, H = 640, 360


@pytest.fixture(scope="module")
def backend():
    return DlibBackend()


@pytest.fixture(scope="module")
def loop_video(tmp_path_factory):
    path = tmp_path_factory.mktemp("loops") / "anchor.mp4"
    truth = action_loop(path, width=W, height=H, seconds=1.6, fps=25, motion=1.5, seed=3)
    return path, truth


@pytest.fixture(scope="module")
def compiled(loop_video, tiny_models, tmp_path_factory, backend):
    path, truth = loop_video
    out = tmp_path_factory.mktemp("avatars")
    result = compile_avatar(path, out, tiny_models.vae, tiny_models.fingerprints["vae"], tracker=DlibTracker(backend),
                            progress=False)
    return result, truth, out


def inside(points: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    return ((points[:, 0] >= boxes[:, 0]) & (points[:, 0] < boxes[:, 2]) &
            (points[:, 1] >= boxes[:, 1]) & (points[:, 1] < boxes[:, 3]))


def test_boxes_hold_mouth_and_chin_in_every_frame(compiled):
    result, truth, _ = compiled
    assert result.status == "compiled" and result.frames == 40
    avatar = load_avatar(result.path)
    boxes = avatar.boxes.numpy()
    for name in ("mouth_left", "mouth_right", "upper_lip", "lower_lip", "chin", "nose_tip"):
        assert inside(truth.point(name), boxes).all(), name
    # the box follows the head: its centre moves with the truth within a few pixels
    centre = (boxes[:, :2] + boxes[:, 2:]) / 2
    lips = truth.point("lips_center")
    assert np.abs((centre - lips) - (centre - lips).mean(axis=0)).max() < 4


def test_masks_cover_the_lips_and_never_the_eyes(compiled):
    result, truth, _ = compiled
    avatar = load_avatar(result.path)
    masks, boxes = avatar.masks.numpy(), avatar.boxes.numpy()
    yy, xx = np.mgrid[0:256, 0:256]
    for i in range(len(masks)):
        for name in ("lips_center", "upper_lip", "lower_lip"):
            x, y = to_box_space(truth.point(name)[i][None], boxes[i])[0]
            assert masks[i, int(round(y)), int(round(x))] >= 200, (i, name)
        for name in ("left_eye", "right_eye"):
            centre = to_box_space(truth.point(name)[i][None], boxes[i])[0]
            radius = EYE_RADIUS * truth.scale[i] * 256 / (boxes[i, 2] - boxes[i, 0])
            eye = (xx - centre[0]) ** 2 + (yy - centre[1]) ** 2 <= radius ** 2
            assert masks[i][eye].max() == 0, (i, name)
        assert masks[i][0].max() == 0 and masks[i][:, 0].max() == 0 and masks[i][-1].max() == 0  # feathered to 0


def test_cache_round_trip_is_exact(compiled, loop_video, tiny_models):
    result, _, _ = compiled
    path, _ = loop_video
    avatar = load_avatar(result.path, vae_fingerprint=tiny_models.fingerprints["vae"])
    loop = read_loop(path)
    assert avatar.frames.shape == (40, H * 3 // 2, W)
    assert all(np.array_equal(avatar.frames[i].numpy(), loop.frames[i]) for i in range(40))
    lm = avatar.landmarks.numpy()
    assert np.array_equal(avatar.boxes.numpy(), face_boxes(lm, W, H))
    crops = np.stack([face_crop(loop.frames[i], avatar.boxes[i].numpy(), W, H, loop.matrix) for i in range(40)])
    again = encode_latents(crops, tiny_models.vae).to(torch.float16)
    assert avatar.latents.shape == (40, 8, 32, 32) and avatar.latents.dtype == torch.float16
    assert torch.equal(again, avatar.latents)
    meta = json.loads((result.path / "avatar.json").read_text())
    assert meta["format"] == 1 and meta["fps"] == "25" and meta["frames"] == 40
    assert meta["vae"]["fingerprint"] == tiny_models.fingerprints["vae"]
    assert len(meta["source"]["sha256"]) == 64
    assert set(meta["timings_s"]) == {"decode", "track", "masks_crops", "latents", "write_wait"}, meta["timings_s"]
    assert meta["tracker"] == "dlib-68" and meta["key"]["tracker"] == "dlib-68"


def test_masked_latent_sees_only_the_upper_half(tiny_models):
    crop = np.random.default_rng(0).integers(0, 256, (1, 256, 256, 3), dtype=np.uint8)
    other = crop.copy()
    other[:, 128:] = 255 - other[:, 128:]
    a, b = encode_latents(crop, tiny_models.vae), encode_latents(other, tiny_models.vae)
    assert torch.equal(a[:, :4], b[:, :4])  # masked half identical: the lower half is blacked out
    assert not torch.equal(a[:, 4:], b[:, 4:])  # the reference half sees the whole crop


@pytest.mark.slow
def test_unchanged_input_is_skipped(compiled, loop_video, tiny_models, backend):
    result, _, out = compiled
    path, _ = loop_video
    stamp = (result.path / "avatar.safetensors").stat().st_mtime_ns
    again = compile_avatar(path, out, tiny_models.vae, tiny_models.fingerprints["vae"], tracker=DlibTracker(backend),
                           progress=False)
    assert again.status == "skipped" and again.frames == 40
    assert (result.path / "avatar.safetensors").stat().st_mtime_ns == stamp
    changed = compile_avatar(path, out, tiny_models.vae, tiny_models.fingerprints["vae"], tracker=DlibTracker(backend),
                             options=CompileOptions(extra_margin=14), progress=False)
    assert changed.status == "compiled"
    forced = compile_avatar(path, out, tiny_models.vae, tiny_models.fingerprints["vae"], tracker=DlibTracker(backend),
                            options=CompileOptions(extra_margin=14), force=True, progress=False)
    assert forced.status == "compiled"
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp or old folders left


def test_other_vae_or_format_is_refused(compiled, tmp_path):
    result, _, _ = compiled
    with pytest.raises(InputError, match="another VAE"):
        load_avatar(result.path, vae_fingerprint="0000000000000000")
    meta = json.loads((result.path / "avatar.json").read_text())
    copy = tmp_path / "old"
    copy.mkdir()
    (copy / "avatar.json").write_text(json.dumps({**meta, "format": 0}))
    with pytest.raises(InputError, match="cache format 0"):
        load_avatar(copy)
    with pytest.raises(InputError, match="not a compiled avatar"):
        load_avatar(tmp_path)


def test_ping_pong_by_arithmetic():
    assert [ping_pong(i, 4) for i in range(10)] == [0, 1, 2, 3, 2, 1, 0, 1, 2, 3]
    steps = torch.arange(100)
    assert ping_pong(steps, 7).tolist() == [ping_pong(i, 7) for i in range(100)]
    assert ping_pong(steps, 1).tolist() == [0] * 100
    assert [ping_pong(i, 2) for i in range(5)] == [0, 1, 0, 1, 0]


@pytest.mark.parametrize("kind", ["png", "jpg", "one-frame-mp4"])
def test_still_avatar(tmp_path, tiny_models, backend, kind):
    if kind == "one-frame-mp4":
        path, truth = tmp_path / "still.mp4", action_loop(tmp_path / "still.mp4", width=W, height=H, seconds=0)
    else:
        path = tmp_path / f"photo.{kind}"
        truth = still_image(path, width=W, height=H)
    result = compile_avatar(path, tmp_path / "avatars", tiny_models.vae, tiny_models.fingerprints["vae"],
                            tracker=DlibTracker(backend), progress=False)
    avatar = load_avatar(result.path)
    assert avatar.num_frames == 1 and avatar.cycle == 1 and avatar.meta["still"]
    assert inside(truth.point("chin"), avatar.boxes.numpy()).all()
    assert avatar.frame_index(torch.arange(5)).tolist() == [0] * 5


def test_smoothing_removes_jitter_on_a_still_head(tmp_path, backend):
    path = tmp_path / "still_noisy.mp4"
    action_loop(path, width=W, height=H, seconds=1.2, motion=0, noise=6.0)
    loop = read_loop(path)
    raw = track(loop.luma, len(loop.frames), backend)
    raw_boxes = face_boxes(raw, W, H)
    boxes = face_boxes(smooth(fill_gaps(raw), 1.5), W, H)
    assert np.ptp(boxes, axis=0).max() <= 2
    assert np.ptp(boxes, axis=0).max() < max(3, np.ptp(raw_boxes, axis=0).max())


def test_frames_without_a_face_are_filled_from_neighbours(tmp_path, tiny_models, backend):
    path = tmp_path / "stepped_out.mp4"
    action_loop(path, width=W, height=H, seconds=1.0, blank=(10, 11, 12))
    result = compile_avatar(path, tmp_path / "a", tiny_models.vae, tiny_models.fingerprints["vae"],
                            tracker=DlibTracker(backend), progress=False)
    assert result.status == "compiled" and "22/25" in result.message
    boxes = load_avatar(result.path, with_frames=False).boxes.numpy().astype(float)
    expected = boxes[9] + (boxes[13] - boxes[9]) * (np.arange(1, 4)[:, None] / 4)
    assert np.abs(boxes[10:13] - expected).max() <= 2


def test_track_file_round_trip(tmp_path, loop_video, tiny_models, backend):
    path, truth = loop_video
    tracks = tmp_path / "tracks"
    first = compile_avatar(path, tmp_path / "a", tiny_models.vae, tiny_models.fingerprints["vae"], tracker=DlibTracker(backend),
                           save_track_dir=tracks, progress=False)
    track_file = tracks / "anchor.track.json"
    assert json.loads(track_file.read_text())["frames"] == 40

    class NoFaceModel:  # proves the track file is used: this backend would fail
        name = "none"

        def detect(self, gray):
            raise AssertionError("tracker called despite --track")

    second = compile_avatar(path, tmp_path / "b", tiny_models.vae, tiny_models.fingerprints["vae"],
                            tracker=DlibTracker(NoFaceModel()), track_file=track_file, progress=False)
    a, b = load_avatar(first.path), load_avatar(second.path)
    assert np.abs(a.boxes.numpy() - b.boxes.numpy()).max() <= 1
    boxes_only = tmp_path / "boxes.json"
    boxes_only.write_text(json.dumps({"boxes": [[250, 100, 360, 230]]}))
    third = compile_avatar(path, tmp_path / "c", tiny_models.vae, tiny_models.fingerprints["vae"],
                           track_file=boxes_only, progress=False)
    c = load_avatar(third.path)
    assert c.boxes[0].tolist() == [250, 100, 360, 240]  # + the v1.5 margin of 10 px
    assert c.masks.numpy().max() == 255


def test_face_too_small_is_refused(tmp_path, loop_video, tiny_models):
    path, _ = loop_video
    tiny_box = tmp_path / "t.json"
    tiny_box.write_text(json.dumps({"boxes": [[300, 150, 330, 180]]}))
    with pytest.raises(InputError, match="face too small"):
        compile_avatar(path, tmp_path / "a", tiny_models.vae, tiny_models.fingerprints["vae"],
                       track_file=tiny_box, progress=False)
    assert not (tmp_path / "a" / "anchor").exists()


# ---- bad inputs: clear errors and nothing left behind ----

def _no_leftovers(out: Path) -> None:
    assert not out.exists() or not list(out.iterdir())


def test_corrupt_video(tmp_path, tiny_models, loop_video):
    good, _ = loop_video
    bad = tmp_path / "cut.mp4"
    bad.write_bytes(good.read_bytes()[:2000])
    out = tmp_path / "out"
    results = compile_many([bad], out, tiny_models.vae, tiny_models.fingerprints["vae"], progress=False)
    assert results[0].status == "failed" and "cut.mp4" in results[0].message
    _no_leftovers(out)
    (tmp_path / "noise.mp4").write_bytes(np.random.default_rng(0).bytes(10_000))  # seeded: never decodable by chance
    with pytest.raises(InputError, match="not a readable video"):
        read_loop(tmp_path / "noise.mp4")


def test_loops_decoded_ahead_are_the_loops_read_now(tmp_path, loop_video):
    """compile decodes each input ahead on a thread: in order, out of order (an input passed over) and after
    a bad file, each loop is what read_loop gives, and a bad file's error comes when it is taken."""
    good = loop_video[0]
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video at all")
    still = tmp_path / "still.png"
    still_image(still, width=W, height=H)
    other = tmp_path / "other.mp4"
    other.write_bytes(good.read_bytes())
    want = read_loop(good)
    ahead = LoopsAhead([good, bad, still, other], fps=None)
    got = ahead.take(good)
    assert len(got.frames) == len(want.frames) and all(np.array_equal(a, b) for a, b in zip(got.frames, want.frames))
    with pytest.raises(InputError, match="bad.mp4"):
        ahead.take(bad)
    assert ahead.take(other).fps == want.fps  # still.png passed over: other.mp4 decoded now
    assert ahead.take(still).still
    ahead.close()
    assert LoopsAhead([good], fps=50).take(good).fps == 50


def test_video_without_a_face(tmp_path, tiny_models, backend):
    path = tmp_path / "empty_studio.mp4"
    action_loop(path, width=W, height=H, seconds=0.4, blank=tuple(range(10)))
    out = tmp_path / "out"
    with pytest.raises(InputError, match="no face found"):
        compile_avatar(path, out, tiny_models.vae, tiny_models.fingerprints["vae"], tracker=DlibTracker(backend), progress=False)
    _no_leftovers(out)


def test_failed_write_leaves_nothing_and_keeps_the_old_avatar(compiled, loop_video, tiny_models, backend,
                                                             monkeypatch):
    result, _, out = compiled
    before = sorted(p.name for p in out.iterdir())

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(cache_mod, "write_frames", broken)
    with pytest.raises(OSError):
        compile_avatar(loop_video[0], out, tiny_models.vae, tiny_models.fingerprints["vae"], tracker=DlibTracker(backend),
                       force=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == before
    assert load_avatar(result.path).num_frames == 40


def test_folder_inputs(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InputError, match="holds no videos"):
        expand_inputs([empty])
    folder = tmp_path / "loops"
    folder.mkdir()
    (folder / "b.mp4").write_bytes(b"x")
    (folder / "a.png").write_bytes(b"x")
    (folder / "notes.txt").write_text("x")
    assert [p.name for p in expand_inputs([folder])] == ["a.png", "b.mp4"]

    def denied(self):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "iterdir", denied)
    with pytest.raises(InputError, match="cannot read folder"):
        expand_inputs([folder])


def test_huge_frames_are_refused(tmp_path):
    path = tmp_path / "huge.mp4"
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=25, options={"preset": "ultrafast"})
        s.width, s.height, s.pix_fmt = 4112, 64, "yuv420p"
        for p in s.encode(av.VideoFrame.from_ndarray(np.zeros((64, 4112, 3), np.uint8), format="rgb24")):
            c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    with pytest.raises(InputError, match="too large"):
        read_loop(path)
