"""The live scheduler: CPU-only decisions about what the GPU core runs next (vLLM's split).

Each step takes the renderable frames of every session, earliest deadline first, up to the
largest captured batch; the frames whose deadlines will have passed before a step could finish
are given up (the session repeats its previous picture and counts it), so an overloaded engine
drops frames instead of falling further and further behind. Offline work fills what is left
of the batch, at lower priority. Admission keeps the sessions' frame rates under the engine's
measured capacity.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container
from concurrent.futures import Future
from dataclasses import dataclass, field
from fractions import Fraction

import torch

from lipstream.live.session import Candidate, Session


UNDERRUN_SLACK_S = 0.02  # the copy back and the encode, after the step


class AdmissionError(RuntimeError):
    """A session was refused: admitting it would make the others miss their deadlines."""


@dataclass
class OfflineJob:
    """Frames of an offline render: avatar slot, loop frames, their windows [n, 50, 384] on the device."""

    slot: int
    frames: list[int]
    windows: torch.Tensor
    future: Future = field(default_factory=Future)
    done: int = 0  # frames handed to a step so far
    results: list = field(default_factory=list)  # (index, I420 frame)


@dataclass
class StepPlan:
    live: list[Candidate]
    offline: list[tuple[OfflineJob, int]]  # (job, frame index within it)
    skipped: list[Candidate]
    cached: list[Candidate] = field(default_factory=list)  # idle frames whose picture is already on the host
    deferred: bool = False  # frames were held back to fill the step

    def __len__(self) -> int:
        return len(self.live) + len(self.offline)


class Scheduler:
    def __init__(self, max_batch: int):
        self.max_batch = max_batch
        self.offline: deque[OfflineJob] = deque()

    def plan(self, sessions: list[Session], now: float, step_s: float, idle_cached: Container[int] = (),
             fill_slack_s: float = 0.0) -> StepPlan:
        """The next step: due live frames by deadline, then offline frames in the room left.

        A step with room left is held back (an empty plan, `deferred`) while every frame it would
        take has more than `fill_slack_s` before its deadline and no offline work waits: the next
        plan finds it fuller.

        Idle frames of the avatars in `idle_cached` need no step (their pictures are kept): they
        are handed out at their media time and take no room in the batch.

        `step_s`: what a step takes on the device now (the core measures it). A speech frame whose
        audio is not all in is rendered anyway once its deadline is that close (with silence for
        the missing audio); a frame whose deadline has passed is skipped.
        """
        frames: list[Candidate] = []
        skipped: list[Candidate] = []
        per_session = []
        for s in sessions:
            mine = s.candidates(now, self.max_batch, margin=step_s + UNDERRUN_SLACK_S,
                                idle_cached=s.avatar in idle_cached)
            per_session.append((s, mine))
            for c in mine:
                if c.deadline < now:
                    skipped.append(c)
                elif not (c.utterance is None and s.avatar in idle_cached):
                    frames.append(c)
        frames.sort(key=lambda c: c.deadline)  # EDF; each session's frames stay in order (rising deadlines)
        live = frames[:self.max_batch]
        deferred = (fill_slack_s > 0 and 0 < len(live) < self.max_batch and not self.offline
                    and live[0].deadline - now > fill_slack_s)
        if deferred:
            live = []
        # a kept idle frame is handed out only after every frame of its session before it
        chosen = {id(c) for c in live}
        cached: list[Candidate] = []
        for s, mine in per_session:
            for c in mine:
                if c.deadline < now or id(c) in chosen:
                    continue
                if c.utterance is None and s.avatar in idle_cached:
                    cached.append(c)
                else:
                    break
        offline: list[tuple[OfflineJob, int]] = []
        room = self.max_batch - len(live)
        for job in self.offline:
            while room and job.done < len(job.frames):
                offline.append((job, job.done))
                job.done += 1
                room -= 1
        while self.offline and self.offline[0].done == len(self.offline[0].frames):
            self.offline.popleft()
        by_session: dict[int, tuple[Session, list[Candidate], list[Candidate]]] = {}
        for c in live + cached:
            by_session.setdefault(c.session.id, (c.session, [], []))[1].append(c)
        for c in skipped:
            by_session.setdefault(c.session.id, (c.session, [], []))[2].append(c)
        for s, taken, gone in by_session.values():
            s.take(taken, gone)
        return StepPlan(live, offline, skipped, cached, deferred)


def admission(sessions: list[Session], fps: Fraction, capacity_fps: float | None, utilisation: float,
              free_slots: int) -> str | None:
    """Why a session at `fps` cannot be admitted now, or None if it can."""
    if free_slots <= 0:
        return f"all {len(sessions)} session slots are in use (LiveOptions.max_sessions)"
    if capacity_fps is None:
        return None
    load = sum(float(s.fps) for s in sessions)
    usable = utilisation * capacity_fps
    if load + float(fps) > usable:
        return (f"the engine is full: {len(sessions)} sessions take {load:.0f} of the {usable:.0f} frames/s it can "
                f"keep on time ({utilisation:.0%} of {capacity_fps:.0f}); another {float(fps):g} fps session "
                "would make them miss deadlines")
    return None
