"""KeySync as a FrameEngine: the same avatars, programs and render loop as MuseTalk, frames from whole scenes.

A request's `window` here is its frame's speech: two HuBERT and two WavLM tokens ([4, 768], `windows`).
KeySync needs a scene's frames ahead of the one it shows (a chunk spans up to 26 segments of 13 frames,
about 13.5 s), so the render's plan is handed over first (`schedule`) and `render` then serves the requests in
that order, generating each scene chunk by chunk as the requests reach it.

For each avatar a square around its face (keysync/avatar.py) is cut from every frame the scene shows,
resized to 512x512 and encoded by the SVD VAE (the posterior mean, where the reference draws a sample),
unless `compile --keysync` prepared them. The masks are the reference's boxes from the landmarks in that
square. The generated square is pasted back through a feathered copy of the mask: every pixel outside the
generated region keeps its exact Y, U and V.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.nn.functional as F

from lipstream.avatar import Avatar
from lipstream.engine.blend import blend_into
from lipstream.keysync.avatar import crop_square, latents, masks, read_prepared
from lipstream.engine.interface import FrameRequest
from lipstream.keysync.options import KeySyncOptions
from lipstream.keysync.pipeline import Inputs, KeySyncNetworks, generate
from lipstream.keysync.schedule import STEP, plan
from lipstream.keysync.speech import frames_of, hubert_features, wavlm_features

TOKEN_RATE = 50  # speech tokens a second
FEATHER = 32  # the blur on the mask's edges where the generated square is pasted back: its size / FEATHER


@dataclass
class KeySyncModels:
    """Everything KeySync runs: its two UNets and the SVD VAE, and the two speech encoders."""

    networks: KeySyncNetworks
    hubert: torch.nn.Module
    wavlm: torch.nn.Module
    device: torch.device
    size: int = 512  # the square the networks see, pixels (the latents are size / 8)
    note: str = ""  # where the weights came from, for the CLI
    fingerprints: dict = field(default_factory=dict)  # no MuseTalk VAE: avatars load without a latent check

    def features(self, speech16: torch.Tensor) -> torch.Tensor:
        """16 kHz samples -> [T, 2, 768] tokens at 50 Hz: HuBERT's and WavLM's."""
        frames = frames_of(speech16.to(self.device, torch.float32))
        with torch.inference_mode():
            hubert = hubert_features(self.hubert, frames).flatten(0, 1)
            wavlm = wavlm_features(self.wavlm, frames).flatten(0, 1)
        t = min(hubert.shape[0], wavlm.shape[0])
        return torch.stack([hubert[:t], wavlm[:t]], dim=1)


def windows(features: torch.Tensor, fps: float | Fraction, frames: int) -> torch.Tensor:
    """[T, 2, 768] tokens -> [frames, 4, 768]: each frame's two HuBERT then two WavLM tokens (at 25 fps
    frame i has tokens 2i and 2i + 1, as the reference pairs them); past the speech's end, zeros."""
    fps = Fraction(fps)
    first = torch.tensor([int(Fraction(i) * TOKEN_RATE / fps) for i in range(frames)], device=features.device)
    index = torch.stack([first, first + 1], dim=1)  # [frames, 2]
    padded = torch.cat([features, features.new_zeros(index.max().item() + 1, *features.shape[1:])])
    pair = padded[index]  # [frames, 2 tokens, 2 models, 768]
    return pair.transpose(1, 2).flatten(1, 2)


class KeySyncEngine:
    """FrameEngine over KeySync (engine/interface.py); `schedule` the render's requests before `render`."""

    buckets = (16,)

    def __init__(self, models: KeySyncModels, options: KeySyncOptions | None = None,
                 check: Callable[[], None] | None = None):
        """`check()`: asked between UNet calls; what it raises stops the render (a cancelled job)."""
        self.models = models
        self.check = check
        self.device = models.device
        self.options = (options or KeySyncOptions()).for_device(models.device.type)
        self.avatars: list[Avatar] = []
        self._squares: list[tuple[int, int, int, int]] = []
        self._prepared: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # compile --keysync's, per avatar
        self._scenes: list[list[FrameRequest]] = []
        self._frames: Iterator[torch.Tensor] | None = None
        self._queue: list[torch.Tensor] = []

    def add_avatar(self, avatar: Avatar) -> int:
        self.avatars.append(avatar)
        self._squares.append(crop_square(avatar.landmarks.float().cpu().numpy(), *avatar.size))
        self._prepared.append(read_prepared(avatar, self.models.networks.vae, self.models.size, self.device))
        return len(self.avatars) - 1

    def clear_avatars(self) -> None:
        self.avatars.clear()
        self._squares.clear()
        self._prepared.clear()

    def warm_up(self, buckets: tuple[int, ...] | None = None) -> dict[str, float]:
        return {}

    def uncaptured(self) -> tuple[int, ...]:
        return ()

    def prefetch(self, requests: list[FrameRequest]) -> None:
        pass

    def schedule(self, scenes: list[list[FrameRequest]]) -> None:
        """The render's requests, scene by scene, in the order `render` will be asked for them."""
        self._scenes = [list(s) for s in scenes if s]
        self._frames, self._queue = self._all_frames(), []

    @torch.inference_mode()
    def render(self, requests: list[FrameRequest]) -> torch.Tensor:
        if self._frames is None:
            raise RuntimeError("KeySyncEngine.render: schedule() the render's requests first")
        while sum(f.shape[0] for f in self._queue) < len(requests):
            self._queue.append(next(self._frames))
        frames = torch.cat(self._queue)
        self._queue = [frames[len(requests):]]
        return frames[:len(requests)]

    def _all_frames(self) -> Iterator[torch.Tensor]:
        for scene in self._scenes:
            yield from self._scene_frames(scene)

    def _scene_frames(self, scene: list[FrameRequest]) -> Iterator[torch.Tensor]:
        """I420 frames of one scene, a chunk at a time. The scene is padded to whole segments (its last frame
        held, silent) and the padding dropped: the reference instead leaves up to 12 frames ungenerated."""
        n = len(scene)
        padded = max(n, 14)
        padded += (STEP - (padded - 1) % STEP) % STEP
        steps = scene + [FrameRequest(scene[-1].avatar, scene[-1].frame, torch.zeros_like(scene[-1].window))] * (
            padded - n)
        for a in {r.avatar for r in steps}:
            self.avatars[a].wait_frames()
        inputs = self._inputs(steps)
        schedule = plan(padded, self.options.chunk_clips)
        for start, video in generate(self.models.networks, schedule, inputs, self.options, self.check):
            keep = video[:max(0, n - start)]
            if keep.shape[0]:
                yield self._paste(steps[start:start + keep.shape[0]], keep, inputs.masks[start:start + keep.shape[0]])

    def _inputs(self, steps: list[FrameRequest]) -> Inputs:
        """The scene's latents, masks and speech, frame by frame: each loop frame it shows cut, encoded and
        masked once, or read from what `compile --keysync` prepared."""
        shown = list(dict.fromkeys((r.avatar, r.frame) for r in steps))  # each loop frame once, in order
        rows: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        for a in dict.fromkeys(a for a, _ in shown):
            frames = [f for b, f in shown if b == a]
            prepared = self._prepared[a]
            if prepared is None:
                avatar, size = self.avatars[a], self.models.size
                made = (latents(avatar, self._squares[a], frames, self.models.networks.vae, size, self.device),
                        torch.from_numpy(masks(avatar, self._squares[a], frames, size)).to(self.device))
            else:
                made = prepared[0][frames], prepared[1][frames]
            rows.update({(a, f): (made[0][k], made[1][k]) for k, f in enumerate(frames)})
        speech = torch.stack([r.window for r in steps]).to(self.device, torch.float32)
        return Inputs(torch.stack([rows[r.avatar, r.frame][0] for r in steps]),
                      torch.stack([rows[r.avatar, r.frame][1] for r in steps])[:, None], speech[:, :2], speech[:, 2:])

    def _paste(self, steps: list[FrameRequest], faces: torch.Tensor, regions: torch.Tensor) -> torch.Tensor:
        """The generated squares blended into copies of their frames through feathered masks: [n, H*3/2, W]."""
        size = self.models.size
        alpha = F.interpolate(regions.float(), size=(size, size), mode="nearest")
        k = size // FEATHER // 2 * 2 + 1
        kernel = torch.ones(1, 1, k, k, device=alpha.device) / k ** 2
        alpha = F.conv2d(alpha, kernel, padding=k // 2) * alpha  # soft inside its edges, 0 outside the region
        alpha = (alpha[:, 0] * 255).round().to(torch.uint8)
        out = []
        for r, face, a in zip(steps, faces, alpha):
            avatar = self.avatars[r.avatar]
            w, h = avatar.size
            frame = avatar.frames[r.frame].to(self.device).clone()
            blend_into(frame, face, a, self._squares[r.avatar], h, w, avatar.meta["colour_matrix"])
            out.append(frame)
        return torch.stack(out)
