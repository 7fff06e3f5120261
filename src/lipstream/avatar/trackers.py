"""The face trackers `compile` can use, behind one interface, and the rule that picks one.

- DWPose (RTMPose-l whole-body, `dw-ll_ucoco_384.pth`): the tracker MuseTalk's own preprocessing uses and its
  training crops came from. Apache-2.0 weights, fetched by `lipstream weights download`. Whole loops run in
  batches on the GPU. As upstream does, each frame is one person's box: the whole frame (no person detector),
  and the face is the keypoints 23-90.
- dlib's HOG detector and 68-point predictor (the `dlib` extra): CPU, frame by frame, tracks the presenter
  among several faces. Its model was trained on data licensed for non-commercial use only.
- a track file (`--track`): landmarks or boxes computed elsewhere; no tracker runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from lipstream.errors import LipStreamError, installed

if TYPE_CHECKING:  # choose_tracker runs before anything heavy is imported: torch and PyAV load with a tracker
    import torch

    from lipstream.avatar.video import Loop

TRACKERS = ("auto", "dwpose", "dlib")
DLIB_LICENCE = ("dlib's 68-point model was trained on iBUG 300-W, whose images are licensed for non-commercial "
                "research only: ask your counsel before shipping a product that uses it")
MIN_FACE_SCORE = 0.3  # a frame's face is found when its 68 points score this on average (DWPose's own
# drawing threshold); below it the frame counts as having no face and takes its neighbours' landmarks


class Tracker(Protocol):
    """68 iBUG landmarks per frame of a loop, NaN where a frame has no face."""

    name: str  # in the avatar's metadata and its cache key: another tracker compiles the avatar again

    def landmarks(self, loop: Loop, progress: Callable[[int], None] | None = None) -> np.ndarray:
        """[frames, 68, 2] float32 frame coordinates."""
        ...


class DWPoseTracker:
    """DWPose on batches of frames where its network is (a GPU: whole loops in a few batches)."""

    def __init__(self, net: torch.nn.Module, name: str, *, batch: int | None = None,
                 min_face_score: float | None = MIN_FACE_SCORE):
        self.net, self.name, self.min_face_score = net.eval(), name, min_face_score
        self.device = next(net.parameters()).device
        self.batch = batch or (16 if self.device.type == "cuda" else 2)

    def warm(self) -> None:
        """One batch of blank frames through the network: on a GPU the first batch of a process pays for cuDNN's
        choices and the kernels' loading (about 1 s of the first loop's 1.6 s), which a thread can pay while
        the VAE loads and the loop decodes."""
        import torch

        from lipstream.models.dwpose import face_landmarks

        with torch.inference_mode():
            face_landmarks(self.net, torch.zeros((self.batch, 3, 64, 64), dtype=torch.uint8, device=self.device))
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()

    def landmarks(self, loop: Loop, progress: Callable[[int], None] | None = None) -> np.ndarray:
        """Each batch is stacked straight into one of two pinned buffers and copied up while the GPU works on
        the one before: the host's copies, not the network, were most of a loop's time. One wait at the end."""
        import torch

        from lipstream.avatar.colour import i420_to_rgb
        from lipstream.models.dwpose import face_landmarks

        n, batch = len(loop.frames), self.batch
        cuda = self.device.type == "cuda"
        staging = [torch.empty((min(batch, n), *loop.frames[0].shape), dtype=torch.uint8, pin_memory=cuda)
                   for _ in range(2 if cuda else 1)]
        copied: list = [None] * len(staging)  # the event after each buffer's last upload
        found = []
        with torch.inference_mode():
            for k, start in enumerate(range(0, n, batch)):
                slot = k % len(staging)
                if copied[slot] is not None:
                    copied[slot].synchronize()  # its upload two batches ago is done: free to refill
                frames = loop.frames[start:start + batch]
                host = staging[slot][:len(frames)]
                np.stack(frames, out=host.numpy())
                i420 = host.to(self.device, non_blocking=True)
                if cuda:
                    copied[slot] = torch.cuda.Event()
                    copied[slot].record()
                rgb = i420_to_rgb(i420, loop.height, loop.width, loop.matrix).permute(0, 3, 1, 2)
                points, scores = face_landmarks(self.net, rgb)
                if self.min_face_score is not None:
                    points[scores.mean(dim=1) < self.min_face_score] = float("nan")
                found.append(points)
                if progress:
                    progress(len(frames))
        return torch.cat(found).cpu().numpy().astype(np.float32, copy=False)


class DlibTracker:
    """dlib's detector and 68-point predictor with face.py's tracking: the presenter among several faces."""

    name = "dlib-68"

    def __init__(self, backend=None):
        from lipstream.avatar.face import DlibBackend

        self.backend = backend or DlibBackend()

    def landmarks(self, loop: Loop, progress: Callable[[int], None] | None = None) -> np.ndarray:
        from lipstream.avatar.face import track

        return track(loop.luma, len(loop.frames), self.backend, progress)


def choose_tracker(wanted: str, models: Path, random_weights: bool) -> str:
    """'dwpose' or 'dlib' for `--tracker wanted`, before anything loads; a one-line error when there is none.

    auto: DWPose where its weights are in the models folder (or the weights are random), else dlib where its
    extra is installed (its licence said), else none."""
    from lipstream.models.layout import DWPOSE_FILE, find

    if wanted not in TRACKERS:
        raise LipStreamError(f"--tracker {wanted!r}: choose from {', '.join(TRACKERS)}")
    dwpose = random_weights or find(models, DWPOSE_FILE.path) is not None
    if wanted == "dwpose" and not dwpose:
        raise LipStreamError(f"--tracker dwpose: no {DWPOSE_FILE.path} in {models}; run `lipstream weights "
                             "download` (needs internet) or copy it there from upstream's download")
    if wanted == "dlib" and not installed("dlib"):
        raise LipStreamError("--tracker dlib: dlib is not installed; pip install 'lipstream[dlib]' (" + DLIB_LICENCE
                             + ")")
    if wanted != "auto":
        return wanted
    if dwpose:
        return "dwpose"
    if installed("dlib"):
        return "dlib"
    raise LipStreamError(f"no face tracker: run `lipstream weights download` for DWPose (Apache-2.0 weights) into "
                         f"{models}, or pass --track FILE with landmarks or boxes, or install the dlib extra (its "
                         "model is for non-commercial use)")


def dwpose_tracker(models: Path, random_weights: bool, random_size: str, device: torch.device) -> DWPoseTracker:
    """DWPose from the models folder, or seeded random weights of `random_size` (which find no face: every
    frame is taken as one, and the landmarks mean nothing)."""
    from lipstream.models.layout import DWPOSE_FILE, find

    if random_weights:
        from lipstream.models.build import build_dwpose

        return DWPoseTracker(build_dwpose(random_size, device=device, seed=0), f"dwpose-random-{random_size}",
                             min_face_score=None)
    from lipstream.models.checkpoint import fingerprint
    from lipstream.models.load import load_dwpose

    path = find(models, DWPOSE_FILE.path)
    assert path is not None  # choose_tracker checked
    net = load_dwpose(path, device=device)
    return DWPoseTracker(net, f"dwpose:{fingerprint(net.state_dict())[:16]}")


def make_tracker(kind: str, models: Path, random_weights: bool, random_size: str, device: torch.device) -> Tracker:
    """The tracker `choose_tracker` named: DWPose on `device`, or dlib (CPU)."""
    return DlibTracker() if kind == "dlib" else dwpose_tracker(models, random_weights, random_size, device)
