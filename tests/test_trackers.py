"""compile's face trackers: which one `--tracker auto` picks, DWPose batched over a loop, and compile end to end
without dlib (the licence-clean default)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch

from lipstream.avatar.trackers import DWPoseTracker, choose_tracker
from lipstream.avatar.video import read_loop
from lipstream.cli import main
from lipstream.errors import LipStreamError
from lipstream.fixtures.avatar import action_loop
from lipstream.models.build import build_dwpose
from lipstream.models.dwpose import face_landmarks


@pytest.fixture
def no_dlib(monkeypatch):
    """dlib made unimportable, as on a machine without the dlib extra."""
    monkeypatch.setitem(sys.modules, "dlib", None)


@pytest.fixture
def models_with_dwpose(tmp_path):
    root = tmp_path / "models"
    (root / "dwpose").mkdir(parents=True)
    (root / "dwpose" / "dw-ll_ucoco_384.pth").write_bytes(b"")
    return root


def test_auto_picks_dwpose_where_its_weights_are_then_dlib_then_says_how_to_get_one(tmp_path, models_with_dwpose,
                                                                                   monkeypatch):
    pytest.importorskip("dlib")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert choose_tracker("auto", models_with_dwpose, random_weights=False) == "dwpose"
    assert choose_tracker("auto", empty, random_weights=True) == "dwpose"  # random DWPose
    assert choose_tracker("auto", empty, random_weights=False) == "dlib"  # asked for nothing better: its licence said
    assert choose_tracker("dlib", models_with_dwpose, random_weights=False) == "dlib"
    with pytest.raises(LipStreamError, match=r"--tracker dwpose: no dwpose/dw-ll_ucoco_384.pth in .*weights download"):
        choose_tracker("dwpose", empty, random_weights=False)
    with pytest.raises(LipStreamError, match="--tracker 'mediapipe': choose from auto, dwpose, dlib"):
        choose_tracker("mediapipe", empty, random_weights=False)
    monkeypatch.setitem(sys.modules, "dlib", None)
    assert choose_tracker("auto", models_with_dwpose, random_weights=False) == "dwpose"
    with pytest.raises(LipStreamError) as e:
        choose_tracker("auto", empty, random_weights=False)
    assert "no face tracker" in str(e.value) and "weights download" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(LipStreamError, match="--tracker dlib: dlib is not installed.*non-commercial"):
        choose_tracker("dlib", models_with_dwpose, random_weights=False)


def test_dwpose_tracks_a_loop_in_batches_as_one_call_would(tmp_path):
    """The tracker's batches (a remainder too) give the landmarks one call on all frames gives; a frame whose
    face scores below the threshold on average is NaN (no face), to be filled from its neighbours."""
    action_loop(tmp_path / "a.mp4", width=320, height=180, seconds=0.28, fps=25)
    loop = read_loop(tmp_path / "a.mp4")
    net = build_dwpose("tiny", device="cpu", seed=1)
    got = DWPoseTracker(net, "t", batch=3, min_face_score=None).landmarks(loop)
    assert got.shape == (7, 68, 2) and np.isfinite(got).all()
    from lipstream.avatar.colour import i420_to_rgb

    rgb = i420_to_rgb(torch.from_numpy(np.stack(loop.frames)), loop.height, loop.width, loop.matrix)
    want, scores = face_landmarks(net, rgb.permute(0, 3, 1, 2))
    np.testing.assert_allclose(got, want.numpy(), atol=1e-3)
    mean = float(scores.mean(dim=1).min())
    assert not np.isnan(DWPoseTracker(net, "t", batch=4, min_face_score=mean - 1e-3).landmarks(loop)).any()
    assert np.isnan(DWPoseTracker(net, "t", batch=4, min_face_score=mean + 1).landmarks(loop)).all()


def test_compile_without_dlib_uses_dwpose_and_says_so(tmp_path, no_dlib, capsys):
    """The licence-clean default: no dlib anywhere, compile runs DWPose (random weights here) and records it; a
    track file needs no tracker at all; without weights or dlib it stops in one line, naming how to get one."""
    loop = tmp_path / "anchor.mp4"
    action_loop(loop, width=320, height=180, seconds=0.4, fps=10)
    tiny = ["--random-weights", "--random-size", "tiny", "--device", "cpu"]
    assert main(["compile", str(loop), "-o", str(tmp_path / "a"), *tiny]) == 0
    out = capsys.readouterr().out
    assert "face tracker: DWPose with random weights" in out and "dlib's" not in out
    meta = json.loads((tmp_path / "a" / "anchor" / "avatar.json").read_text())
    assert meta["tracker"] == "dwpose-random-tiny" and meta["key"]["tracker"] == "dwpose-random-tiny"
    # another tracker is another avatar: compiled again, not skipped as unchanged
    track = tmp_path / "anchor.track.json"
    track.write_text(json.dumps({"boxes": [[100, 40, 200, 150]]}))
    assert main(["compile", str(loop), "-o", str(tmp_path / "a"), "--track", str(track), "--timings", *tiny]) == 0
    out = capsys.readouterr().out
    assert "compiled" in out
    assert all(step in out for step in ("torch and the device", "anchor: landmarks", "anchor: VAE latents"))
    assert json.loads((tmp_path / "a" / "anchor" / "avatar.json").read_text())["tracker"] == "track-file"
    (tmp_path / "models").mkdir()
    assert main(["compile", str(loop), "-o", str(tmp_path / "b"), "--models", str(tmp_path / "models")]) != 0
    err = capsys.readouterr().err.strip()
    assert "no face tracker" in err and "weights download" in err and "--track" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "b").exists()


def test_compile_loads_dwpose_from_the_models_folder_as_upstream_lays_it_out(tmp_path, tiny_checkpoint, no_dlib,
                                                                            capsys):
    """`dwpose/dw-ll_ucoco_384.pth` (an mmengine checkpoint of the tiny size here) through the real loader:
    picked by auto with dlib absent, named in the avatar by its weights' fingerprint."""
    assert (tiny_checkpoint / "dwpose" / "dw-ll_ucoco_384.pth").is_file()
    loop = tmp_path / "anchor.mp4"
    action_loop(loop, width=320, height=180, seconds=0.4, fps=10)
    assert main(["compile", str(loop), "-o", str(tmp_path / "a"), "--models", str(tiny_checkpoint),
                 "--device", "cpu"]) == 0, capsys.readouterr().err
    assert "face tracker: DWPose (dw-ll_ucoco_384, Apache-2.0)" in capsys.readouterr().out
    meta = json.loads((tmp_path / "a" / "anchor" / "avatar.json").read_text())
    assert meta["tracker"].startswith("dwpose:") and len(meta["tracker"]) == len("dwpose:") + 16
