"""The live core's step runner (vLLM's model runner): a StepPlan in, frames on the host out, each to its owner.

`launch` gathers a plan's frames (their avatars' loop frames, their feature-table rows or offline
windows) into the engine's captured step, then copies the I420 frames to pinned host buffers on a
side stream; `finish` waits for that copy and hands each frame to its session's hand-off (which
copies it out and frees the buffer) or to its offline job (copied out on a copy thread too). The
host buffers are allocated once per frame size: HOST_BUFFERS steps can be on their way to the host,
or being copied out, at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from lipstream.engine import StepEngine
from lipstream.live.features import FeatureTable
from lipstream.live.scheduler import OfflineJob, StepPlan

HOST_BUFFERS = 4  # steps whose frames can be on their way to the host (or being copied out) at once


class _Uses:
    """How many frames of a host buffer the sessions have yet to copy out (the core waits before reuse)."""

    def __init__(self):
        self._n = 0
        self._cv = threading.Condition()

    def hold(self, n: int) -> None:
        with self._cv:
            self._n += n

    def release(self) -> None:
        with self._cv:
            self._n -= 1
            if self._n <= 0:
                self._cv.notify_all()

    def wait_free(self) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: self._n <= 0, timeout=5.0):
                raise RuntimeError("host frames were not copied out within 5 s")


@dataclass
class InFlight:
    """A launched step: its plan, its frames per frame size (step positions, host frames), its events."""

    plan: StepPlan
    groups: list[tuple[list[int], torch.Tensor, _Uses]]
    done: torch.cuda.Event | None  # the copy to the host is done (None: no GPU, done at launch)
    timing: tuple[torch.cuda.Event, torch.cuda.Event] | None
    launched_at: float


def _nothing() -> None:
    pass


def _land(job: OfflineJob, frames: np.ndarray, positions: list[int], indices: list[int], release: Callable) -> None:
    try:
        job.land(frames, positions, indices)
    finally:
        release()


def _now(fn: Callable, *args) -> None:
    fn(*args)


class StepRunner:
    """Runs the scheduler's steps on the engine; owns the host buffers and the copy stream."""

    def __init__(self, engine: StepEngine, table: FeatureTable, submit: Callable[..., object] | None = None):
        """`submit(fn, *args)` runs a copy out of a host buffer (a thread pool's submit; None: at once)."""
        self.engine, self.table = engine, table
        self._submit = submit or _now
        self.device = engine.device
        self.cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._host: dict[tuple[int, int], list] = {}  # frame size -> [(device staging, pinned host, event, uses)]
        self._next: dict[tuple[int, int], int] = {}

    def warm_sizes(self) -> None:
        """Host buffers (and blend graphs) for every resident frame size."""
        for a in self.engine.avatars:
            w, h = a.size
            if (w, h) in self._host:
                continue
            n = self.engine.buckets[-1]
            self._host[(w, h)] = [
                (torch.empty(n, h * 3 // 2, w, dtype=torch.uint8, device=self.device) if self.cuda else None,
                 torch.empty(n, h * 3 // 2, w, dtype=torch.uint8, pin_memory=self.cuda),
                 torch.cuda.Event() if self.cuda else None, _Uses()) for _ in range(HOST_BUFFERS)]
            self._next[(w, h)] = 0

    @torch.inference_mode()
    def measure(self, avatar: int = 0) -> dict[int, float]:
        """What a step of each bucket takes (two runs, the second counts): the scheduler's estimate."""
        loop = self.engine.avatars[avatar].num_frames
        out = {}
        for b in self.engine.buckets:
            for _ in range(2):
                t = time.perf_counter()
                self.engine.render_rows([avatar] * b, [i % loop for i in range(b)], self.table.table,
                                        self.table.idle * b)
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                out[b] = time.perf_counter() - t
        return out

    def launch(self, plan: StepPlan) -> InFlight:
        t = time.perf_counter()
        avatars = [c.avatar for c in plan.live] + [job.avatar for job, _ in plan.offline]
        frames = [c.loop_frame for c in plan.live] + [job.frames[i] for job, i in plan.offline]
        rows = [r for c in plan.live for r in c.rows]
        windows = torch.stack([job.windows[i] for job, i in plan.offline]) if plan.offline else None
        timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self.cuda else None
        if timing:
            timing[0].record()
        groups = self.engine.render_rows(avatars, frames, self.table.table, rows, windows)
        if timing:
            timing[1].record()
        out, done = [], None
        for where, dev in groups:
            size = (dev.shape[-1], dev.shape[-2] * 2 // 3)
            k = self._next[size]
            self._next[size] = (k + 1) % HOST_BUFFERS
            staging, host, event, use = self._host[size][k]
            use.wait_free()  # the sessions have copied out what an earlier step left in it
            n = len(where)
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(event)  # its last copy to the host is done
                staging[:n].copy_(dev)  # device to device: frees the graph's buffer for the next step at once
                self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._copy_stream):
                    host[:n].copy_(staging[:n], non_blocking=True)
                    event.record(self._copy_stream)
                done = event
            else:
                host[:n].copy_(dev)
            out.append((where, host[:n], use))
        return InFlight(plan, out, done, timing, t)

    def finish(self, f: InFlight) -> float:
        """Wait for the step's frames on the host and hand each to its owner; the step's time (s)."""
        if f.done is not None:
            f.done.synchronize()  # every group's copy went on the one copy stream, in order
        took = time.perf_counter() - f.launched_at  # no GPU: the step ran inside the launch
        if f.timing is not None:
            took = f.timing[0].elapsed_time(f.timing[1]) / 1000
        n_live = len(f.plan.live)
        now = time.monotonic()
        for where, host, use in f.groups:
            frames = host.numpy()
            landing: dict[int, tuple[OfflineJob, list[int], list[int]]] = {}  # per job: buffer positions, its frames
            for j, i in enumerate(where):
                if i >= n_live:
                    job, index = f.plan.offline[i - n_live]
                    _, positions, indices = landing.setdefault(id(job), (job, [], []))
                    positions.append(j)
                    indices.append(index)
            use.hold(sum(i < n_live for i in where) + len(landing))  # each session frame, each job's copy
            for j, i in enumerate(where):
                if i < n_live:
                    c = f.plan.live[i]
                    f.plan.sessions[c.session].handoff.deliver(c, frames[j], now, use.release)
            for job, positions, indices in landing.values():  # off the core thread: 100 MB a 1080p step
                self._submit(_land, job, frames, positions, indices, use.release)
        return took

    @staticmethod
    def hand_out_cached(plan: StepPlan, idle_loops: dict[int, np.ndarray], now: float) -> None:
        """Idle frames whose pictures are kept (no step): to their sessions at once."""
        for c in plan.cached:
            plan.sessions[c.session].handoff.deliver(c, idle_loops[c.avatar][c.loop_frame], now, _nothing)
