"""The live engine's offline lane as a FrameEngine (engine/interface.py), so `render_program` runs through it.

A server keeps one LiveEngine: its networks, captured steps and avatars. A render job handed to
`render_program(..., engine=OfflineLane(live))` plans, decodes speech and writes its MP4 exactly
as the CLI does, while its frames go through the live scheduler at lower priority than the
sessions' (LiveEngine.render_offline). The CLI itself keeps its direct Engine: nothing shares it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from lipstream.avatar import Avatar
from lipstream.engine.interface import FrameRequest
from lipstream.live.engine import LiveEngine


class OfflineLane:
    """A FrameEngine whose avatars are the live engine's resident ones and whose frames go through its steps."""

    def __init__(self, live: LiveEngine, cancelled: Callable[[], bool] | None = None):
        self.live = live
        self.device = live.device
        self.buckets = live.engine.buckets
        self.avatars: list[Avatar] = []
        self._live_index: list[int] = []  # our avatar index -> the live engine's
        self._cancelled = cancelled or (lambda: False)

    def clear_avatars(self) -> None:
        self.avatars, self._live_index = [], []

    def add_avatar(self, avatar: Avatar) -> int:
        """This lane's index of the avatar: the live engine's resident one (the same loaded object, or the
        same folder), added there if it is not resident yet."""
        live = self.live.engine.avatars
        index = next((i for i, a in enumerate(live) if a is avatar), None)
        if index is None:
            where = Path(avatar.path).resolve()
            index = next((i for i, a in enumerate(live) if Path(a.path).resolve() == where), None)
        if index is None:
            index = self.live.add_avatar(avatar)
        self.avatars.append(live[index])
        self._live_index.append(index)
        return len(self.avatars) - 1

    def warm_up(self) -> None:
        """The live engine is warm from its start."""

    def render(self, requests: list[FrameRequest]) -> torch.Tensor:
        """[B, H*3/2, W] uint8 I420 on the CPU, in order: one offline job per avatar among them."""
        if self._cancelled():
            raise JobCancelled("the job was cancelled")
        by_avatar: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            by_avatar.setdefault(r.avatar, []).append(i)
        jobs = [(where, self.live.render_offline(self._live_index[a], [requests[i].frame for i in where],
                                                 torch.stack([requests[i].window for i in where])))
                for a, where in by_avatar.items()]
        done = [(where, job.result()) for where, job in jobs]
        out = np.empty((len(requests), *done[0][1].shape[1:]), np.uint8)
        for where, frames in done:
            out[where] = frames
        return torch.from_numpy(out)


class JobCancelled(RuntimeError):
    """Raised inside a render when its job was cancelled: the render stops, its output is not written."""
