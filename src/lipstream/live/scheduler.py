"""The live scheduler: CPU-only decisions about what the GPU core runs next (vLLM's split).

Each step takes the renderable frames of every session, earliest deadline first, up to the
largest captured batch; the frames whose deadlines will have passed before a step could finish
are given up (the session repeats its previous picture and counts it), so an overloaded engine
drops frames instead of falling further and further behind. Offline work fills what is left
of the batch, at lower priority. Admission keeps the sessions' frame rates under the engine's
measured capacity.

Its state is its own, changed on the core thread (and under the engine's lock by render_offline):
the offline jobs queued, what a step costs (per bucket, measured at start, and recently).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Container
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import torch

from lipstream.live.options import LiveOptions
from lipstream.live.request import Candidate
from lipstream.live.session import Session

UNDERRUN_SLACK_S = 0.02  # the copy back and the encode, after the step
FILL_POLL_S = 0.003  # a held-back step is planned again this soon (or at the next push)


@dataclass
class OfflineJob:
    """Frames of an offline render: the avatar's index, loop frames, their windows [n, 50, 384] on the device.

    Frame i lands in `out[rows[i]]` (host I420), copied there from the step's host buffer on a copy
    thread; the future's result is `out` once every frame has landed. A cancelled future drops the
    frames not yet handed to a step."""

    avatar: int
    frames: list[int]
    windows: torch.Tensor
    out: np.ndarray  # [rows, H*3/2, W] uint8
    rows: list[int]  # where each frame goes in `out`
    future: Future = field(default_factory=Future)
    idle_loop: bool = False  # the engine's own: an avatar's idle loop kept for idle sessions, not a caller's job
    done: int = 0  # frames handed to a step so far
    landed: int = 0  # frames copied into `out` so far
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def land(self, frames: np.ndarray, positions: list[int], indices: list[int]) -> None:
        """Copy the step's host frames at `positions` (this job's frames `indices`) into `out`."""
        try:
            rows = [self.rows[i] for i in indices]
            k = len(rows)
            if rows == list(range(rows[0], rows[0] + k)) and positions == list(range(positions[0], positions[0] + k)):
                self.out[rows[0]:rows[0] + k] = frames[positions[0]:positions[0] + k]  # one memcpy, no GIL
            else:
                self.out[rows] = frames[positions]
        except BaseException as e:  # noqa: BLE001  (the job's caller gets it, not a copy thread's log)
            self._settle(error=e)
            return
        with self._lock:
            self.landed += k
            complete = self.landed == len(self.frames)
        if complete:
            self._settle()

    def _settle(self, error: BaseException | None = None) -> None:
        try:
            if error is None:
                self.future.set_result(self.out)
            else:
                self.future.set_exception(error)
        except InvalidStateError:  # cancelled, or failed already
            pass


@dataclass
class StepPlan:
    live: list[Candidate]
    offline: list[tuple[OfflineJob, int]]  # (job, frame index within it)
    skipped: list[Candidate]
    cached: list[Candidate] = field(default_factory=list)  # idle frames whose picture is already on the host
    deferred: bool = False  # frames were held back to fill the step
    sessions: dict[int, Session] = field(default_factory=dict)  # the candidates' sessions, by id

    def __len__(self) -> int:
        return len(self.live) + len(self.offline)


def _smoothed(last: float | None, new: float) -> float:
    """A recent average: each new value weighs a fifth."""
    return new if last is None else 0.8 * last + 0.2 * new


class Scheduler:
    def __init__(self, max_batch: int, fill_slack_s: float = 0.0):
        self.max_batch = max_batch
        self.fill_slack_s = fill_slack_s
        self.offline: deque[OfflineJob] = deque()
        self.step_s: dict[int, float] = {}  # what a step of each bucket took at start (LiveEngine measures)
        self._recent: float | None = None  # device time of recent steps
        self._by_bucket: dict[int, float] = {}  # device time of recent steps, per bucket

    # --- what a step costs -----------------------------------------------------------------------

    def observe_step(self, seconds: float, frames: int = 0) -> None:
        """A finished step's device time (of `frames` frames: kept per bucket too)."""
        self._recent = _smoothed(self._recent, seconds)
        if frames and self.step_s:
            b = self._bucket(frames)
            self._by_bucket[b] = _smoothed(self._by_bucket.get(b), seconds)

    def take_steps(self, step_s: dict[int, float]) -> None:
        """Another engine's steps (measured): what the old ones took recently no longer says anything."""
        self.step_s.update(step_s)
        self._by_bucket.clear()
        self._recent = None

    def _bucket(self, frames: int) -> int:
        return min((b for b in self.step_s if b >= frames), default=max(self.step_s))

    def step_duration(self, frames: int) -> float:
        """What a step of this many frames will take on the device: its bucket's recent steps, else its
        bucket's measure at start (when the core plans the next step just in time, live/core.py)."""
        if not self.step_s:
            return self.step_estimate()
        b = self._bucket(frames)
        return self._by_bucket.get(b, self.step_s[b])

    def step_estimate(self) -> float:
        """What the next step will take on the device: recent steps' (small at low load, full under load)."""
        if self._recent is not None:
            return self._recent
        return self.step_s[min(self.step_s)] if self.step_s else 0.05

    def capacity_fps(self) -> float:
        """The most frames a second the steps can make (the best bucket's rate)."""
        return max(b / s for b, s in self.step_s.items())

    def capacity_within(self, step_budget_s: float) -> float | None:
        """The most frames a second from steps no longer than `step_budget_s` (None: no step is that short)."""
        rates = [b / s for b, s in self.step_s.items() if s <= step_budget_s]
        return max(rates) if rates else None

    # --- offline work ----------------------------------------------------------------------------

    def add_offline(self, job: OfflineJob) -> None:
        self.offline.append(job)

    def fail_offline(self, error: BaseException) -> None:
        for job in self.offline:
            job._settle(error)

    # --- planning --------------------------------------------------------------------------------

    def plan(self, sessions: list[Session], now: float, idle_cached: Container[int] = ()) -> StepPlan:
        """The next step: due live frames by deadline, then offline frames in the room left.

        A step with room left is held back (an empty plan, `deferred`) while every frame it would
        take has more than `fill_slack_s` before its deadline and no offline work waits: the next
        plan finds it fuller.

        Idle frames of the avatars in `idle_cached` need no step (their pictures are kept): they
        are handed out at their media time and take no room in the batch.

        A speech frame whose audio is not all in is rendered anyway once its deadline is a step
        (step_estimate) away (with silence for the missing audio); a frame whose deadline has
        passed is skipped.

        A step takes at most `batch_limit(sessions)` frames, offline ones included.
        """
        margin = self.step_estimate() + UNDERRUN_SLACK_S
        most = self.batch_limit(sessions)
        frames: list[Candidate] = []
        skipped: list[Candidate] = []
        per_session = []
        for s in sessions:
            mine, given_up = s.request.candidates(now, most, margin, s.playout.play_frame, idle_cached)
            if given_up:  # played before the core reached them: their audio still goes to the encoder
                s.handoff.skip(given_up)
            per_session.append((s, mine))
            for c in mine:
                if c.deadline < now:
                    skipped.append(c)
                elif not (c.utterance is None and c.avatar in idle_cached):
                    frames.append(c)
        frames.sort(key=lambda c: c.deadline)  # EDF; each session's frames stay in order (rising deadlines)
        live = frames[:most]
        deferred = (self.fill_slack_s > 0 and 0 < len(live) < most and not self.offline
                    and live[0].deadline - now > self.fill_slack_s)
        if deferred:
            live = []
        # a kept idle frame is handed out only after every frame of its session before it
        chosen = {id(c) for c in live}
        cached_frames: list[Candidate] = []
        for s, mine in per_session:
            for c in mine:
                if c.deadline < now or id(c) in chosen:
                    continue
                if c.utterance is None and c.avatar in idle_cached:
                    cached_frames.append(c)
                else:
                    break
        offline: list[tuple[OfflineJob, int]] = []
        room = most - len(live)
        for job in self.offline:
            if job.future.cancelled():
                job.done = len(job.frames)  # what is left of it is dropped
            while room and job.done < len(job.frames):
                offline.append((job, job.done))
                job.done += 1
                room -= 1
        while self.offline and self.offline[0].done == len(self.offline[0].frames):
            self.offline.popleft()
        by_id = {s.id: s for s in sessions}
        taken: dict[int, tuple[list[Candidate], list[Candidate]]] = {}
        for c in live + cached_frames:
            taken.setdefault(c.session, ([], []))[0].append(c)
        for c in skipped:
            taken.setdefault(c.session, ([], []))[1].append(c)
        for sid, (mine, gone) in taken.items():
            by_id[sid].request.take(mine, gone)
            if gone:
                by_id[sid].handoff.skip(gone)
        return StepPlan(live, offline, skipped, cached_frames, deferred, by_id)

    def batch_limit(self, sessions: list[Session]) -> int:
        """The most frames a step may take: the largest bucket whose step (measured at start) is no longer than
        the session closest to the speech allows (step_budget_s). A frame waits up to one step to be taken and
        runs in the next, so under a burst a longer step makes its own frames late and, waited on, the next
        step's: at 16 low-latency sessions on an H100, padded 16-frame steps of 33 ms where 30 ms is the budget
        (the frames over the limit go in the next step, first by deadline). Every bucket when nothing is
        measured yet or no bucket is short enough (admission then refuses such sessions)."""
        if not self.step_s or not sessions:
            return self.max_batch
        budget = min(step_budget_s(s.o) for s in sessions)
        short = [b for b, took in self.step_s.items() if took <= budget and b <= self.max_batch]
        return max(short) if short else self.max_batch

    def idle_wait(self, sessions: list[Session], now: float, idle_cached: Container[int] = ()) -> float:
        """Until the next idle frame falls due (a push wakes the core earlier), rounded up to a tick
        of half the idle lead, so the idle frames of sessions opened moments apart share a step."""
        margin = self.step_estimate() + UNDERRUN_SLACK_S  # what plan() passes the sessions
        due = [s.request.idle_due(max(s.request.next_frame, s.playout.play_frame), margin, idle_cached)
               for s in sessions]
        if not due:
            return 0.01
        tick = max(0.002, min(margin, min(float(1 / s.fps) for s in sessions)) / 2)
        wake = math.ceil(min(due) / tick) * tick
        return max(0.0005, min(0.05, wake - now))


class PlanTimer:
    """When to plan the next step while one runs on the GPU: just in time, `lead` before its end.

    Planned at once (as soon as the step before is launched), the next step takes only the frames ready
    then and waits behind the running one: a frame ready a moment later waits for two steps. Planned
    as the running step ends, it takes every frame ready by then, and none waits more than one step
    before its own. The lead is what the core's turn takes from waking to its step launched (features,
    planning, the launch; recent turns), plus a margin that grows by a millisecond each time the GPU
    was found idle (the running step ended before the next was launched) and shrinks slowly otherwise."""

    MARGIN_S = (0.001, 0.008)  # least and most margin

    def __init__(self, prepare_s: float = 0.003):
        self.ends = 0.0  # when the step in flight should be done on the device (time.monotonic())
        self.prepare_s = prepare_s
        self.margin_s = self.MARGIN_S[0]

    def started(self, now: float, duration_s: float) -> None:
        """A step is in flight from `now` (the one before it done) for about `duration_s`."""
        self.ends = now + duration_s

    def wait_s(self, now: float) -> float:
        """How long until the next step should be planned (<= 0: now)."""
        return self.ends - self.prepare_s - self.margin_s - now

    def launched(self, prepared_s: float) -> None:
        """A turn timed by wait_s launched its step `prepared_s` after waking, before the GPU ran dry."""
        self.prepare_s = _smoothed(self.prepare_s, prepared_s)
        self.margin_s = max(self.MARGIN_S[0], self.margin_s - 0.0001)

    def idled(self) -> None:
        """The step in flight was done before the next was launched: plan earlier."""
        self.margin_s = min(self.MARGIN_S[1], self.margin_s + 0.001)


def step_budget_s(options: LiveOptions) -> float:
    """How long a step may take for a session of these options to keep its frames on time under load. A frame
    whose window's audio is in waits up to one step to be taken, runs in the next, and is copied out and
    encoded (UNDERRUN_SLACK_S), within its playout delay less the window's look-ahead: 30 ms for a low-latency
    session (120 ms, 40 ms ahead), 55 ms for a default one (250 ms, 120 ms ahead)."""
    ahead_s = options.window_ahead_steps * 0.02
    return (options.playout_delay_s - ahead_s - UNDERRUN_SLACK_S) / 2


def admission(sessions: list[Session], fps: Fraction, capacity_fps: float | None, utilisation: float,
              free: int, tightest: tuple[float, float | None] | None = None) -> str | None:
    """Why a session at `fps` cannot be admitted now, or None if it can. `tightest`: the shortest playout delay
    of the sessions with this one (s), and what the steps short enough for it make a second (None: no step is):
    every session's frames share the steps, so the session closest to the speech sets how long they may be."""
    if free <= 0:
        return f"all {len(sessions)} session places are in use (LiveOptions.max_sessions)"
    if capacity_fps is None:
        return None
    load = sum(float(s.fps) for s in sessions)

    def full(which: str, capacity: float, making: str) -> str | None:
        usable = utilisation * capacity
        if load + float(fps) <= usable:
            return None
        return (f"the engine is full{which}: {len(sessions)} sessions take {load:.0f} of the {usable:.0f} frames/s "
                f"{making} keep on time ({utilisation:.0%} of {capacity:.0f}); another {float(fps):g} fps session "
                "would make them miss deadlines")

    why = full("", capacity_fps, "it can")
    if why is not None or tightest is None:
        return why
    delay_ms, within = tightest[0] * 1000, tightest[1]
    if within is None:
        return (f"no step of this engine is short enough for a session {delay_ms:.0f} ms behind the speech; "
                "a longer playout delay (latency=default) is allowed")
    return full(f" for sessions {delay_ms:.0f} ms behind the speech", within, "that steps short enough for that")
