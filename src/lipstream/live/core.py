"""The live engine's core: one thread that owns the GPU and turns `step()` (vLLM's EngineCore, at small scale).

Each step: encode the feature windows that new audio completed (one batched Whisper call for every
session, at most once a feature tick), ask the scheduler for the next step's frames, launch them (the
runner: the engine's captured graphs, network step and blend into I420), hand idle frames whose
pictures are kept straight to their sessions, and only then finish the previous step: wait for its
frames in pinned host memory (copied on a side stream) and hand each to its session or offline job.
So the CPU plans step k+1 while the GPU runs step k, just in time: as step k nears its end (the
scheduler's PlanTimer), so that step k+1 takes every frame whose features came in meanwhile.

The front end (live/engine.py) adds sessions, avatars and offline jobs under `lock`, and sets `wake`
when something new needs the core; the core reads them at its next step. What runs next is the
scheduler's (live/scheduler.py), how it runs the runner's (live/runner.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch

from lipstream.audio.features import whisper_features
from lipstream.faults import inject
from lipstream.live.features import FeatureTable, StreamingWhisper
from lipstream.live.options import LiveOptions
from lipstream.live.runner import InFlight, StepRunner
from lipstream.live.scheduler import FILL_POLL_S, PlanTimer, Scheduler, StepPlan
from lipstream.live.session import Session

if TYPE_CHECKING:
    from lipstream.engine.engines import StepEngine
    from lipstream.models import MuseTalk

log = logging.getLogger(__name__)
T = TypeVar("T")
COALESCE_S = 0.004  # turns at least this far apart: a push wakes the core, and 24 sessions push 1200 times a second


def _hand_back_gpu_cache() -> None:
    """After running out of GPU memory: the allocator's cached blocks back to the GPU, for whatever runs next."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@dataclass
class EngineStats:
    steps: int = 0
    frames: int = 0  # live frames rendered
    offline_frames: int = 0
    idle_cached_frames: int = 0  # idle frames handed out from the kept idle loops (no step)
    out_of_memory_steps: int = 0  # steps that ran out of GPU memory (their jobs failed, their frames given up)
    out_of_memory_features: int = 0  # feature encodes that ran out of GPU memory (once more; then skipped)
    whisper_windows: int = 0
    whisper_runs: int = 0  # encoder calls: windows per call is the batching the feature tick buys
    gpu_busy_s: float = 0.0  # GPU time of the steps (CUDA events), 0 on the CPU
    steps_after_idle: int = 0  # steps launched after the one before had ended (the GPU ran dry between them)
    core_cpu_s: float = 0.0  # CPU time of the core thread itself (a full core: the engine keeps up no more)
    started_at: float = field(default_factory=time.monotonic)
    batch_sizes: dict[int, int] = field(default_factory=dict)


class LiveCore:
    """The sessions, the feature table, the scheduler and the runner of one engine, and the thread that steps them."""

    def __init__(self, models: MuseTalk, engine: StepEngine, options: LiveOptions):
        self.m, self.engine, self.o = models, engine, options
        self.device = models.device
        self.table = FeatureTable(options.max_sessions, options.ring_steps, self.device, models.dtype)
        self.whisper = StreamingWhisper(models, self.table, options.context_steps, options.hop_steps,
                                        options.lookahead_steps, trace=options.trace_whisper)
        self.scheduler = Scheduler(engine.buckets[-1], options.fill_slack_s)
        # frames are copied out of the host buffers on threads (memcpy without the GIL) and encoded in
        # worker processes (EncodePool, the front end's): in this process x264 and PyAV held the GIL
        # ~0.8 ms a frame and, retaking it constantly, starved the core and the callers' event loops
        self.copy = ThreadPoolExecutor(max(2, min(8, (os.cpu_count() or 2) // 2)), thread_name_prefix="live-copy")
        self.runner = StepRunner(engine, self.table, self.copy.submit)
        self.sessions: dict[int, Session] = {}
        self.idle_loops: dict[int, np.ndarray] = {}  # avatar -> its idle loop [n, H*3/2, W] I420, on the host
        self.stats = EngineStats()
        self.lock = threading.Lock()  # sessions, avatars and offline jobs change under it, between steps
        self.wake = threading.Event()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._swap: tuple[StepEngine, dict[int, float], threading.Event] | None = None
        self._inflight: InFlight | None = None
        self._planned: StepPlan | None = None  # planned and not yet launched
        self._features_at = 0.0
        self._last_turn = 0.0
        self.timer = PlanTimer()

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lipstream-live-core", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The thread ends after its step in flight; the copy threads finish what they hold."""
        self._stop.set()
        self.wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.copy.shutdown(wait=True)

    def take_engine(self, engine: StepEngine, step_s: dict[int, float], timeout_s: float) -> None:
        """Move onto another engine, warm and holding the avatars resident when it was made, between two steps
        with nothing in flight (avatars added since are added to it here)."""
        with self.lock:
            for a in self.engine.avatars[len(engine.avatars):]:  # added meanwhile
                engine.add_avatar(a)
            if self._thread is None:  # not started: nothing runs yet
                self._take(engine, step_s)
                return
            taken = threading.Event()
            self._swap = (engine, step_s, taken)
        self.wake.set()
        if not taken.wait(timeout_s):
            raise RuntimeError(f"the live engine's core did not take the compiled steps within {timeout_s} s")

    def _take(self, engine: StepEngine, step_s: dict[int, float]) -> None:
        self.engine = self.runner.engine = engine
        self.runner.warm_sizes()
        self.scheduler.take_steps(step_s)

    # --- the core thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while not self._stop.is_set():
                    wait = self.step()
                    self.stats.core_cpu_s = time.thread_time()
                    if wait is not None:
                        self.wake.wait(wait)
                        self.wake.clear()
                        # a turn scans every session and runs Whisper: turns at least COALESCE_S apart
                        # (otherwise 24 sessions' 20 ms pushes make 1200 turns a second, and their
                        # Python starves every other thread)
                        time.sleep(max(0.0, self._last_turn + COALESCE_S - time.monotonic()))
                    self._last_turn = time.monotonic()
                if self._inflight is not None:
                    self._finish(self._inflight)
                    self._inflight = None
        except BaseException as e:  # noqa: BLE001 (handed to every caller)
            log.exception("the live engine's core stopped")
            stopped = RuntimeError("the live engine's core stopped")
            with self.lock:  # render_offline adds jobs under it only while no error is set
                self.error = e
                self.scheduler.fail_offline(stopped)
            for plan in (self._planned, self._inflight and self._inflight.plan):  # jobs taken off the queue
                for job, _ in plan.offline if plan is not None else ():
                    job._settle(stopped)
            for s in list(self.sessions.values()):
                s.close()

    def step(self) -> float | None:
        """One turn: (the step in flight nearing its end) features -> schedule -> launch this step -> finish the
        previous one. Returns how long the thread may wait for something new (None: a step is in flight, go
        on at once)."""
        if self._swap is not None:  # new steps (use_compiled): taken with nothing in flight
            self._drain()
            with self.lock:
                engine, step_s, taken = self._swap
                self._take(engine, step_s)
                self._swap = None
            taken.set()
        just_in_time = self._await_in_flight()
        woke = time.monotonic()
        with self.lock:
            sessions = list(self.sessions.values())
            # Whisper runs over every session's ready windows at most once a feature tick (the first
            # window after a quiet spell at once): unaligned 20 ms pushes otherwise make a small
            # encoder run at nearly every turn. Before a step planned just in time, always: those
            # turns come once a step
            now = time.monotonic()
            features_wait = self._features_at + self._feature_tick(sessions) - now
            if (features_wait <= 0 or just_in_time) and self._features(sessions):
                self._features_at = now
            now = time.monotonic()
            plan = self.scheduler.plan(sessions, now, self.idle_loops)
            self._planned = plan  # until launched: what the core fails should it stop here
            try:
                launched = self._launch(plan) if len(plan) else None
            except torch.cuda.OutOfMemoryError as e:
                launched = self._out_of_memory(plan, e)
            self._planned = None
        if just_in_time and launched is not None:
            if self._inflight.done.query():  # ended before this step was in
                self._ran_dry()
            else:
                self.timer.launched(time.monotonic() - woke)
        self.runner.hand_out_cached(plan, self.idle_loops, now)
        self.stats.idle_cached_frames += len(plan.cached)
        self._drain()
        self._inflight = launched
        if launched is not None and launched.done is None:  # no GPU: the step already ran
            self._drain()
        if self._inflight is not None:
            # it runs once the step before it is done (drained just now): from now, for its bucket's time
            self.timer.started(time.monotonic(), self.scheduler.step_duration(len(plan)))
            return None
        wait = FILL_POLL_S if plan.deferred else self.scheduler.idle_wait(sessions, time.monotonic(),
                                                                          self.idle_loops)
        return min(wait, features_wait) if features_wait > 0 else wait

    def _await_in_flight(self) -> bool:
        """With a step on the GPU, wait until the next one is due to be planned (the scheduler's PlanTimer).
        True when this turn was timed to a step's end; a step found done already is finished first."""
        f = self._inflight
        if f is None or f.done is None:
            return False
        if f.done.query():
            self._drain()  # done already: its frames go out before this turn's work
            self._ran_dry()
            return False
        ahead = self.timer.wait_s(time.monotonic())
        if ahead > 0:
            self._stop.wait(ahead)  # not a push's wake: nothing launched before then would run sooner
        return True

    def _ran_dry(self) -> None:
        """The step in flight ended before the next was launched: the GPU idled between them."""
        self.timer.idled()
        self.stats.steps_after_idle += 1

    def _feature_tick(self, sessions: list[Session]) -> float:
        """The engine's feature tick, or a shorter one a session asks for (a low-latency session's)."""
        return min([self.o.feature_tick_s, *(s.o.feature_tick_s for s in sessions)])

    def _drain(self) -> None:
        """Finish the step in flight, if any."""
        if self._inflight is not None:
            self._finish(self._inflight)
            self._inflight = None

    def _features(self, sessions: list[Session]) -> int:
        """Encode every window that can be now (stream), or whole ended utterances; how many."""
        jobs, whole = [], 0
        for s in sessions:
            if self.o.features == "stream":
                jobs += s.request.window_jobs()
            else:
                for audio, rows in s.request.whole_utterances():
                    feats = self._out_of_memory_once_more(lambda: whisper_features(torch.from_numpy(audio), self.m))
                    if feats is not None:
                        index = torch.tensor(rows[:len(feats)], device=self.device)
                        self.table.table.index_copy_(0, index, feats[:len(rows)].to(self.table.table.dtype))
                    whole += 1
        if jobs:
            self.stats.whisper_runs += self._out_of_memory_once_more(lambda: self.whisper.run(jobs)) or 0
            self.stats.whisper_windows += len(jobs)
        return len(jobs) + whole

    def _out_of_memory_once_more(self, encode: Callable[[], T]) -> T | None:
        """Whisper over sessions' audio, run again once if it runs out of GPU memory (the allocator's cache
        handed back first: what pushed it over is usually a job's work beside it); None if it runs out twice.
        Those windows then go without: their frames keep the table rows' earlier features, a wrong mouth for
        a fraction of a second, where letting the error through would stop the engine and every session."""
        for attempt in (1, 2):
            try:
                inject("features")  # the fault hook (faults.py)
                return encode()
            except torch.cuda.OutOfMemoryError as e:
                self.stats.out_of_memory_features += 1
                _hand_back_gpu_cache()
                if attempt == 2:
                    log.warning("the sessions' speech features ran out of GPU memory twice; those windows go "
                                "without (their frames keep earlier features): %s", str(e).splitlines()[0])
        return None

    def _launch(self, plan: StepPlan) -> InFlight:
        if plan.offline and not all(job.idle_loop for job, _ in plan.offline):
            inject("step")  # the fault hook (faults.py): a step carrying a caller's job
        inflight = self.runner.launch(plan)
        self.stats.steps += 1
        n = len(plan)
        self.stats.batch_sizes[n] = self.stats.batch_sizes.get(n, 0) + 1
        return inflight

    def _out_of_memory(self, plan: StepPlan, error: BaseException) -> None:
        """A step that ran out of GPU memory (it raises while launching, before any host buffer is taken):
        the jobs with frames in it fail with the error, its live frames are given up (played as the picture
        before, their audio goes on), the allocator's cache goes back to the GPU, and the core goes on. The
        steps were sized at start: what pushed this one over is what runs beside them, a job's work most of
        all, so the sessions play on and only the jobs pay."""
        jobs = {id(job): job for job, _ in plan.offline}
        log.warning("a step of %d live and %d job frames ran out of GPU memory; %d jobs fail, the sessions go on: %s",
                    len(plan.live), len(plan.offline), len(jobs), str(error).splitlines()[0] if str(error) else "")
        for job in jobs.values():
            job.done = len(job.frames)  # nothing more of it is planned
            job._settle(error)
        for sid, session in plan.sessions.items():
            mine = [c for c in plan.live if c.session == sid]
            if mine:
                session.handoff.skip(mine)
        _hand_back_gpu_cache()
        self.stats.out_of_memory_steps += 1

    def _finish(self, f: InFlight) -> None:
        took = self.runner.finish(f)
        if f.timing is not None:
            self.stats.gpu_busy_s += took
        self.scheduler.observe_step(took, len(f.plan))
        self.stats.frames += len(f.plan.live)
        self.stats.offline_frames += len(f.plan.offline)
