"""The live engine: many sessions, one GPU, one core thread that owns it.

Each turn of the core: encode the feature windows that new audio completed (one batched
Whisper call for every session), ask the scheduler for the next step, launch it (the engine's
captured graphs: network step and blend into I420), and only then finish the previous step:
wait for its frames to arrive in pinned host memory (copied on a side stream) and hand each
session its frames. So the CPU plans step k+1 while the GPU runs step k. Sessions
copy their frames out on threads and encode them in worker processes (EncodePool), off this
process's GIL; idle frames come from each avatar's idle loop, rendered once at start.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from lipstream.audio.features import whisper_features
from lipstream.avatar import Avatar, load_avatar, ping_pong
from lipstream.engine import Engine
from lipstream.media.encode_pool import EncodePool
from lipstream.live.features import FeatureTable, StreamingWhisper
from lipstream.live.options import LiveOptions, preset
from lipstream.live.scheduler import UNDERRUN_SLACK_S, AdmissionError, OfflineJob, Scheduler, StepPlan, admission
from lipstream.live.session import Session

if TYPE_CHECKING:
    from lipstream.models import MuseTalk

log = logging.getLogger(__name__)
COMPILED_FROM = 8
COALESCE_S = 0.004
FILL_POLL_S = 0.003  # a held-back step is planned again this soon (or at the next push)
HOST_SLOTS = 4  # steps whose frames can be on their way to the host (or being copied out) at once


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


def _nothing() -> None:
    pass


@dataclass
class EngineStats:
    steps: int = 0
    frames: int = 0  # live frames rendered
    offline_frames: int = 0
    idle_cached_frames: int = 0  # idle frames handed out from the kept idle loops (no step)
    whisper_windows: int = 0
    whisper_runs: int = 0  # encoder calls: windows per call is the batching the feature tick buys
    gpu_busy_s: float = 0.0  # GPU time of the steps (CUDA events), 0 on the CPU
    started_at: float = field(default_factory=time.monotonic)
    batch_sizes: dict[int, int] = field(default_factory=dict)


@dataclass
class _InFlight:
    plan: StepPlan
    groups: list[tuple[list[int], torch.Tensor, _Uses]]  # per frame size: step positions, host frames
    done: torch.cuda.Event | None
    timing: tuple[torch.cuda.Event, torch.cuda.Event] | None
    launched_at: float


class LiveEngine:
    """Resident avatars, live sessions and offline frames on one Engine. Use as a context manager
    (or start() / close()); open sessions with open_session()."""

    def __init__(self, models: MuseTalk, options: LiveOptions | str = "realtime", *,
                 decode_rows: str = "auto", compile: str = "off", encode_processes: int | None = None):
        self.o = preset(options) if isinstance(options, str) else options
        self.m = models
        self.device = models.device
        buckets = tuple(sorted(set(self.o.buckets)))
        # Inductor (when asked) for the buckets of 8 frames and up, where a loaded engine's steps
        # are (each bucket costs a compile); the small ones run uncompiled
        self.engine = Engine(models, buckets[-1], buckets=buckets, decode_rows=decode_rows, compile=compile,
                             compile_buckets=tuple(b for b in buckets if b >= COMPILED_FROM) or (buckets[-1],))
        self.table = FeatureTable(self.o.max_sessions, self.o.ring_steps, self.device, models.dtype)
        self.whisper = StreamingWhisper(models, self.table, self.o.context_steps, self.o.hop_steps,
                                        self.o.lookahead_steps, trace=self.o.trace_whisper)
        self.scheduler = Scheduler(buckets[-1])
        self.sessions: dict[int, Session] = {}
        self._free = list(range(self.o.max_sessions))[::-1]
        self._next_id = 0
        self._lock = threading.Lock()  # sessions and avatars change under it, between steps
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.capacity_fps = self.o.capacity_fps
        self.step_s: dict[int, float] = {}  # measured time of a step per bucket
        self._recent: float | None = None  # device time of recent steps
        self.stats = EngineStats()
        cuda = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self._host: dict[tuple[int, int], list] = {}  # frame size -> [(device staging, pinned host, event)]
        self._k: dict[tuple[int, int], int] = {}
        self.idle_loops: dict[int, np.ndarray] = {}  # avatar slot -> its idle loop [n, H*3/2, W] I420, on the host
        self._idle_bytes = 0  # kept and being rendered
        # frames are copied out of the host buffers on threads (memcpy without the GIL) and encoded in
        # worker processes (EncodePool, started with the first encoded session): in this process x264
        # and PyAV held the GIL ~0.8 ms a frame and, retaking it constantly, starved the core and the
        # callers' event loops
        self._copy = ThreadPoolExecutor(max(2, min(8, (os.cpu_count() or 2) // 2)), thread_name_prefix="live-copy")
        self._encode_processes = encode_processes or max(1, (os.cpu_count() or 2) - 2)
        self.encode_pool: EncodePool | None = None
        self._pool_lock = threading.Lock()

    # --- set-up ---------------------------------------------------------------------------------

    def add_avatar(self, avatar: Avatar | str | Path) -> int:
        """Keep an avatar resident (a compiled avatar folder or a loaded one); returns its slot."""
        if not isinstance(avatar, Avatar):
            avatar = load_avatar(avatar, self.device, vae_fingerprint=self.m.fingerprints.get("vae"))
        with self._lock:
            slot = self.engine.add_avatar(avatar)
        if self._thread is not None:
            self._warm_sizes()
            self._keep_idle_loop(slot)
        return slot

    def start(self) -> LiveEngine:
        """Capture every bucket, measure what a step costs, then start the core thread."""
        if self._thread is not None:
            return self
        if not self.engine.avatars:
            raise ValueError("add an avatar before starting the live engine")
        if self.device.type == "cuda":
            # torch's CPU threads only run small ops here (resampling pushes); idle, they spin
            # and take the cores the encoders need (13 of 16 cores busy at 8 sessions otherwise)
            torch.set_num_threads(1)
        self.whisper.idle_window()
        if self.o.features == "stream":
            self.whisper.warm()
        self.engine.warm_up()
        self._warm_sizes()
        self._measure()
        if self.o.encode:
            self._encoders()
        self._thread = threading.Thread(target=self._run, name="lipstream-live-core", daemon=True)
        self._thread.start()
        for f in [self._keep_idle_loop(slot) for slot in range(len(self.engine.avatars))]:
            if f is not None:
                f.result()  # started means warm: idle sessions cost no step from the first frame
        return self

    def _keep_idle_loop(self, slot: int) -> Future | None:
        """Render avatar `slot`'s idle loop once (offline lane) and keep it, if it fits idle_cache_gib."""
        a = self.engine.avatars[slot]
        w, h = a.size
        size = a.num_frames * (h * 3 // 2) * w
        if self._idle_bytes + size > self.o.idle_cache_gib * 2**30:
            log.info("live engine: avatar %d's idle loop (%.0f MiB) does not fit idle_cache_gib; rendered live",
                     slot, size / 2**20)
            return None
        self._idle_bytes += size
        window = self.table.table[self.table.idle].reshape(1, -1, self.table.table.shape[-1])
        future = self.render_offline(slot, list(range(a.num_frames)), window.expand(a.num_frames, -1, -1))

        def keep(f: Future) -> None:
            if f.exception() is None:
                loop = f.result()
                loop.flags.writeable = False
                self.idle_loops[slot] = loop

        future.add_done_callback(keep)
        return future

    def _warm_sizes(self) -> None:
        """Host buffers (and blend graphs) for every resident frame size."""
        for a in self.engine.avatars:
            w, h = a.size
            if (w, h) in self._host:
                continue
            cuda = self.device.type == "cuda"
            n = self.engine.buckets[-1]
            self._host[(w, h)] = [(torch.empty(n, h * 3 // 2, w, dtype=torch.uint8, device=self.device) if cuda else None,
                                   torch.empty(n, h * 3 // 2, w, dtype=torch.uint8, pin_memory=cuda),
                                   torch.cuda.Event() if cuda else None, _Uses()) for _ in range(HOST_SLOTS)]
            self._k[(w, h)] = 0

    @torch.inference_mode()
    def _measure(self) -> None:
        """Time each bucket (two runs, the second counts): the scheduler's step estimate and admission's capacity."""
        slot = 0
        loop = self.engine.avatars[slot].num_frames
        for b in self.engine.buckets:
            for _ in range(2):
                t = time.perf_counter()
                self.engine.render_rows([slot] * b, [i % loop for i in range(b)], self.table.table,
                                        self.table.idle * b)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.step_s[b] = time.perf_counter() - t
        if self.capacity_fps is None:
            self.capacity_fps = max(b / s for b, s in self.step_s.items())
        log.info("live engine: steps %s s, capacity %.0f frames/s",
                 {b: round(s, 4) for b, s in self.step_s.items()}, self.capacity_fps)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._copy.shutdown(wait=True)
        for s in list(self.sessions.values()):
            s.close()
        if self.encode_pool is not None:
            self.encode_pool.close()

    def __enter__(self) -> LiveEngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # --- sessions and jobs ----------------------------------------------------------------------

    def open_session(self, avatar: int = 0, *, fps: Fraction | float | None = None, encode: bool | None = None,
                     start_frame: int = 0, playout_delay_s: float | None = None) -> Session:
        """A new session on a resident avatar, idle until speech is pushed; AdmissionError if full.
        `playout_delay_s` (None: the engine's) is this session's own: a client may trade latency for
        fewer late frames; the scheduler orders every frame by its own session's deadline."""
        self._raise_error()
        if playout_delay_s is not None and not 0.05 <= playout_delay_s <= 5:
            raise ValueError(f"playout_delay_s: {playout_delay_s:g}; 0.05 to 5 s is allowed")
        if not 0 <= avatar < len(self.engine.avatars):
            raise ValueError(f"avatar: slot {avatar}; {len(self.engine.avatars)} avatars are resident")
        a = self.engine.avatars[avatar]
        fps = Fraction(fps if fps is not None else a.fps).limit_denominator(1001)
        if not 1 <= fps <= 60:
            raise ValueError(f"fps: {float(fps):g}; 1 to 60 is allowed")
        with self._lock:
            why = admission(list(self.sessions.values()), fps, self.capacity_fps, self.o.utilisation, len(self._free))
            if why is not None:
                raise AdmissionError(why)
            slot = self._free.pop()
            sid = self._next_id
            self._next_id += 1
        w, h = a.size
        try:
            a.wait_frames(1)
            rest = a.frames[int(ping_pong(start_frame, a.num_frames))].cpu().numpy().copy()  # before frame 0 is ready
            o = self.o if playout_delay_s is None else self.o.replace(playout_delay_s=playout_delay_s)
            session = Session(sid, slot, avatar, a.fps, fps, a.size, a.num_frames, o, self.table, rest,
                              self._wake.set, self._copy.submit, start_frame)
            if self.o.encode if encode is None else encode:
                session.attach_encoder(self._encoders().open(
                    w, h, fps, audio=self.o.audio_codec, preset=self.o.preset, crf=self.o.crf,
                    gop_frames=max(1, round(self.o.gop_s * float(fps))), matrix=a.meta.get("colour_matrix", "bt601"),
                    on_packets=session._encoded, on_error=session._encoder_failed))
        except BaseException:
            with self._lock:
                self._free.append(slot)  # the slot goes back
            raise
        with self._lock:
            self.sessions[sid] = session
        self._wake.set()
        return session

    def _encoders(self) -> EncodePool:
        with self._pool_lock:  # not the core's lock: starting the processes takes a moment
            if self.encode_pool is None:
                self.encode_pool = EncodePool(self._encode_processes)
            return self.encode_pool

    def close_session(self, session: Session) -> None:
        with self._lock:
            if self.sessions.pop(session.id, None) is not None:
                self._free.append(session.slot)
        session.close()

    def render_offline(self, slot: int, frames: list[int], windows: torch.Tensor) -> Future:
        """Offline frames through the same steps at lower priority: loop frames of avatar `slot`
        with their windows [n, 50, 384]. The future's result: [n, H*3/2, W] uint8 I420."""
        if len(windows) != len(frames):
            raise ValueError("one window per frame")
        job = OfflineJob(slot, list(frames), windows.to(self.device, self.m.dtype))
        with self._lock:
            self.scheduler.offline.append(job)
        self._wake.set()
        return job.future

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("the live engine's core stopped") from self._error

    # --- the core thread ------------------------------------------------------------------------

    def _run(self) -> None:
        inflight: _InFlight | None = None
        last_turn = features_at = 0.0
        try:
            with torch.inference_mode():
                while not self._stop.is_set():
                    if inflight is not None and inflight.done is not None and inflight.done.query():
                        self._finish(inflight)  # done already: its frames go out before this turn's work
                        inflight = None
                    with self._lock:
                        sessions = list(self.sessions.values())
                        # Whisper runs over every session's ready windows at most once a feature tick
                        # (the first window after a quiet spell at once): unaligned 20 ms pushes
                        # otherwise make a small encoder run at nearly every turn
                        now = time.monotonic()
                        features_wait = features_at + self.o.feature_tick_s - now
                        if features_wait <= 0 and self._features(sessions):
                            features_at = now
                        now = time.monotonic()
                        plan = self.scheduler.plan(sessions, now, self._step_estimate(), self.idle_loops,
                                                   self.o.fill_slack_s)
                        launched = self._launch(plan) if len(plan) else None
                    self._hand_out_cached(plan, now)
                    if inflight is not None:
                        self._finish(inflight)
                    inflight = launched
                    if inflight is not None and inflight.done is None:  # no GPU: the step already ran
                        self._finish(inflight)
                        inflight = None
                    if inflight is None:
                        wait = FILL_POLL_S if plan.deferred else self._idle_wait(sessions)
                        self._wake.wait(min(wait, features_wait) if features_wait > 0 else wait)
                        self._wake.clear()
                        # Pushes wake the core; a turn scans every session and runs Whisper, so turns
                        # are at least COALESCE_S apart (otherwise 24 sessions' 20 ms pushes make
                        # 1200 turns a second, and their Python starves every other thread).
                        time.sleep(max(0.0, last_turn + COALESCE_S - time.monotonic()))
                    last_turn = time.monotonic()
                if inflight is not None:
                    self._finish(inflight)
        except BaseException as e:  # noqa: BLE001 (handed to every caller)
            log.exception("the live engine's core stopped")
            self._error = e
            for s in list(self.sessions.values()):
                s.close()
            for job in self.scheduler.offline:
                if not job.future.done():
                    job.future.set_exception(RuntimeError("the live engine's core stopped"))

    def _hand_out_cached(self, plan: StepPlan, now: float) -> None:
        for c in plan.cached:
            c.session.deliver(c, self.idle_loops[c.session.avatar][c.loop_frame], now, _nothing)
        self.stats.idle_cached_frames += len(plan.cached)

    def _step_estimate(self) -> float:
        """What the next step will take on the device: recent steps' (small at low load, full under load)."""
        return self._recent if self._recent is not None else self.step_s.get(self.engine.buckets[0], 0.05)

    def _idle_wait(self, sessions: list[Session]) -> float:
        """Until the next idle frame falls due (a push wakes the core earlier), rounded up to a tick
        of half the idle lead, so the idle frames of sessions opened moments apart share a step."""
        now = time.monotonic()
        margin = self._step_estimate() + UNDERRUN_SLACK_S  # what the scheduler passes the sessions
        due = [s.idle_due(max(s.next_frame, s.play_frame), margin, s.avatar in self.idle_loops) for s in sessions]
        if not due:
            return 0.01
        tick = max(0.002, min(margin, min(float(1 / s.fps) for s in sessions)) / 2)
        wake = math.ceil(min(due) / tick) * tick
        return max(0.0005, min(0.05, wake - now))

    def _features(self, sessions: list[Session]) -> int:
        """Encode every window that can be now (stream), or whole ended utterances; how many."""
        jobs, whole = [], 0
        for s in sessions:
            if self.o.features == "stream":
                jobs += s.window_jobs()
            else:
                for audio, rows in s.whole_utterances():
                    feats = whisper_features(torch.from_numpy(audio), self.m.whisper, self.m.feature_extractor)
                    index = torch.tensor(rows[:len(feats)], device=self.device)
                    self.table.table.index_copy_(0, index, feats[:len(rows)].to(self.table.table.dtype))
                    whole += 1
        if jobs:
            self.stats.whisper_runs += self.whisper.run(jobs)
            self.stats.whisper_windows += len(jobs)
        return len(jobs) + whole

    def _launch(self, plan: StepPlan) -> _InFlight:
        t = time.perf_counter()
        e = self.engine
        slots = [c.session.avatar for c in plan.live] + [job.slot for job, _ in plan.offline]
        frames = [c.loop_frame for c in plan.live] + [job.frames[i] for job, i in plan.offline]
        rows = [r for c in plan.live for r in c.rows]
        windows = torch.stack([job.windows[i] for job, i in plan.offline]) if plan.offline else None
        cuda = self.device.type == "cuda"
        timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        if timing:
            timing[0].record()
        groups = e.render_rows(slots, frames, self.table.table, rows, windows)
        if timing:
            timing[1].record()
        out, done = [], None
        for where, dev in groups:
            size = (dev.shape[-1], dev.shape[-2] * 2 // 3)
            k = self._k[size]
            self._k[size] = (k + 1) % HOST_SLOTS
            staging, host, event, use = self._host[size][k]
            use.wait_free()  # the sessions have copied out what an earlier step left in it
            n = len(where)
            if cuda:
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
        self.stats.steps += 1
        self.stats.batch_sizes[len(slots)] = self.stats.batch_sizes.get(len(slots), 0) + 1
        return _InFlight(plan, out, done, timing, t)

    def _finish(self, f: _InFlight) -> None:
        if f.done is not None:
            f.done.synchronize()  # every group's copy went on the one copy stream, in order
        took = time.perf_counter() - f.launched_at  # no GPU: the step ran inside the launch
        if f.timing is not None:
            took = f.timing[0].elapsed_time(f.timing[1]) / 1000
            self.stats.gpu_busy_s += took
        n_live = len(f.plan.live)
        self._recent = took if self._recent is None else 0.8 * self._recent + 0.2 * took
        now = time.monotonic()
        for where, host, use in f.groups:
            frames = host.numpy()
            use.hold(sum(i < n_live for i in where))
            for j, i in enumerate(where):
                if i < n_live:
                    c = f.plan.live[i]
                    c.session.deliver(c, frames[j], now, use.release)
                else:
                    job, index = f.plan.offline[i - n_live]
                    job.results.append((index, frames[j].copy()))
                    if len(job.results) == len(job.frames):
                        job.results.sort(key=lambda r: r[0])
                        job.future.set_result(np.stack([r[1] for r in job.results]))
        self.stats.frames += n_live
        self.stats.offline_frames += len(f.plan.offline)

