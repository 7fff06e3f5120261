"""The live engine's offline lane as a FrameEngine (engine/interface.py), so `render_program` runs through it.

A server keeps one LiveEngine: its networks, captured steps and avatars. A render job handed to
`render_program(..., engine=OfflineLane(live))` plans, decodes speech and writes its MP4 exactly
as the CLI does, while its frames go through the live scheduler at lower priority than the
sessions' (LiveEngine.render_offline). The CLI itself keeps its direct ModuleEngine: nothing shares it.

The render asks for its batches in order and says which come next (`prefetch`): those are queued
on the live engine at once, so its steps run back to back while the render hands the previous
batch to the encoders (asked one at a time, the GPU waited for each round trip). Each batch lands
in one of a few host buffers the lane owns, reused round-robin.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import torch

from lipstream.avatar import Avatar
from lipstream.engine.interface import FrameRequest
from lipstream.live.engine import LiveEngine

AHEAD = 2  # batches queued on the live engine beyond the one the render waits for


class OfflineLane:
    """A FrameEngine whose avatars are the live engine's resident ones and whose frames go through its steps."""

    def __init__(self, live: LiveEngine, cancelled: Callable[[], bool] | None = None):
        self.live = live
        self.device = live.device
        self.buckets = live.engine.buckets
        self.avatars: list[Avatar] = []
        self._live_index: list[int] = []  # our avatar index -> the live engine's
        self._cancelled = cancelled or (lambda: False)
        self._queued: deque[tuple[list[FrameRequest], np.ndarray, list[Future]]] = deque()  # asked for, in order
        self._buffers: list[np.ndarray] = []  # AHEAD + 2: the queued batches', and the one last returned
        self._next_buffer = 0

    def clear_avatars(self) -> None:
        self._drop_queued()
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

    def warm_up(self, buckets: tuple[int, ...] | None = None) -> dict[str, float]:
        """The live engine is warm from its start."""
        return {}

    def uncaptured(self) -> tuple[int, ...]:
        return ()

    def prefetch(self, requests: list[FrameRequest]) -> None:
        """Queue a batch the render will ask for next (the same list object), unless AHEAD are queued."""
        if len(self._queued) <= AHEAD and requests:
            self._queued.append(self._submit(requests))

    def render(self, requests: list[FrameRequest]) -> torch.Tensor:
        """[B, H*3/2, W] uint8 I420 on the CPU, in order: a view of the lane's buffer, valid until the next call."""
        if self._cancelled():
            self._drop_queued()
            raise JobCancelled("the job was cancelled")
        if self._queued and self._queued[0][0] is requests:
            _, out, jobs = self._queued.popleft()
        else:  # not the batch queued next (or none was): the hints are dropped
            self._drop_queued()
            _, out, jobs = self._submit(requests)
        for job in jobs:
            job.result()
        return torch.from_numpy(out[:len(requests)])

    def _submit(self, requests: list[FrameRequest]) -> tuple[list[FrameRequest], np.ndarray, list[Future]]:
        """One offline job per avatar among the requests, each landing in its rows of the next buffer."""
        w, h = self.avatars[requests[0].avatar].size
        rows = max(self.buckets[-1], len(requests))
        if not self._buffers or self._buffers[0].shape != (rows, h * 3 // 2, w):
            self._buffers = [np.empty((rows, h * 3 // 2, w), np.uint8) for _ in range(AHEAD + 2)]
        out = self._buffers[self._next_buffer]
        self._next_buffer = (self._next_buffer + 1) % len(self._buffers)
        by_avatar: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            by_avatar.setdefault(r.avatar, []).append(i)
        jobs = [self.live.render_offline(self._live_index[a], [requests[i].frame for i in where],
                                         torch.stack([requests[i].window for i in where]), out=out, rows=where)
                for a, where in by_avatar.items()]
        return requests, out, jobs

    def _drop_queued(self) -> None:
        """Cancel the queued batches; their buffers may still be written, so the lane takes fresh ones."""
        if self._queued:
            for _, _, jobs in self._queued:
                for job in jobs:
                    job.cancel()
            self._queued.clear()
            self._buffers = []


class JobCancelled(RuntimeError):
    """Raised inside a render when its job was cancelled: the render stops, its output is not written."""
