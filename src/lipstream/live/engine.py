"""The live engine: many sessions, one GPU, one core thread that owns it (vLLM's engine core, at small scale).

Each turn of the core: encode the feature windows that new audio completed (one batched
Whisper call for every session), ask the scheduler for the next step, launch it (the runner: the
engine's captured graphs, network step and blend into I420), and only then finish the previous
step: wait for its frames to arrive in pinned host memory (copied on a side stream) and hand each
session its frames. So the CPU plans step k+1 while the GPU runs step k. Sessions copy their
frames out on threads and encode them in worker processes (media.EncodePool), off this process's
GIL; idle frames come from each avatar's idle loop, rendered once at start.

This class is the front end: avatars, sessions (opened, admitted, closed), offline jobs, and the
core thread's loop; what runs next is the scheduler's (live/scheduler.py), how it runs the
runner's (live/runner.py), a session's state its own (live/session.py).
"""

from __future__ import annotations

import logging
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
from lipstream.engine.engines import PackageEngine, ModuleEngine, StepEngine
from lipstream.live.features import FeatureTable, StreamingWhisper
from lipstream.live.handoff import FrameHandoff
from lipstream.live.items import SessionClock
from lipstream.live.options import LiveOptions, preset
from lipstream.live.playout import Playout
from lipstream.live.request import SpeechRequest
from lipstream.live.runner import InFlight, StepRunner
from lipstream.live.interface import SessionRefused
from lipstream.live.scheduler import FILL_POLL_S, OfflineJob, Scheduler, admission
from lipstream.live.session import Session
from lipstream.media.encode_pool import EncodePool
from lipstream.engine.options import EngineOptions

if TYPE_CHECKING:
    from lipstream.engine.aot import CompiledNetworks
    from lipstream.models import MuseTalk

log = logging.getLogger(__name__)
COMPILED_FROM = 8  # Inductor (when asked) for the buckets of this many frames and up
COALESCE_S = 0.004


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


class LiveEngine:
    """Resident avatars, live sessions and offline frames on one FrameEngine. Use as a context manager
    (or start() / close()); open sessions with open_session()."""

    def __init__(self, models: MuseTalk, options: LiveOptions | str = "realtime", *,
                 decode_rows: str = "auto", inductor: str = "off", encode_processes: int | None = None,
                 compiled: CompiledNetworks | None = None):
        """`inductor`: "off", "vae" or "all", torch.compile of the step (engine options). `compiled`: the
        frame steps as ahead-of-time packages (engine/aot.py) instead of the modules' (then `models` needs
        only its Whisper encoder, for the streaming features)."""
        self.o = preset(options) if isinstance(options, str) else options
        self.m = models
        self._decode_rows = decode_rows
        self.device = models.device
        buckets = tuple(sorted(set(self.o.buckets)))
        # Inductor (when asked) for the buckets of 8 frames and up, where a loaded engine's steps
        # are (each bucket costs a compile); the small ones run uncompiled
        if compiled is not None:
            if inductor != "off":
                raise ValueError("an engine on compiled packages takes no inductor option")
            self.engine: StepEngine = PackageEngine(compiled, EngineOptions(batch=buckets[-1], decode_rows=decode_rows),
                                                     buckets=buckets)
        else:
            self.engine = ModuleEngine(models, EngineOptions(batch=buckets[-1], decode_rows=decode_rows, inductor=inductor),
                                 buckets=buckets,
                                 compile_buckets=tuple(b for b in buckets if b >= COMPILED_FROM) or (buckets[-1],))
        self.table = FeatureTable(self.o.max_sessions, self.o.ring_steps, self.device, models.dtype)
        self.whisper = StreamingWhisper(models, self.table, self.o.context_steps, self.o.hop_steps,
                                        self.o.lookahead_steps, trace=self.o.trace_whisper)
        self.scheduler = Scheduler(buckets[-1], self.o.fill_slack_s)
        # frames are copied out of the host buffers on threads (memcpy without the GIL) and encoded in
        # worker processes (EncodePool, started with the first encoded session): in this process x264
        # and PyAV held the GIL ~0.8 ms a frame and, retaking it constantly, starved the core and the
        # callers' event loops
        self._copy = ThreadPoolExecutor(max(2, min(8, (os.cpu_count() or 2) // 2)), thread_name_prefix="live-copy")
        self.runner = StepRunner(self.engine, self.table, self._copy.submit)
        self.sessions: dict[int, Session] = {}
        self._free_rings = list(range(self.o.max_sessions))[::-1]  # each session's rows of the feature table
        self._next_id = 0
        self._lock = threading.Lock()  # sessions, avatars and offline jobs change under it, between steps
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.capacity_fps = self.o.capacity_fps
        self.start_phases: dict[str, float] = {}  # seconds of each step of start()
        self.stats = EngineStats()
        self._rest0: dict[int, np.ndarray] = {}  # avatar -> its loop frame 0 on the host (a session's first picture)
        self.idle_loops: dict[int, np.ndarray] = {}  # avatar -> its idle loop [n, H*3/2, W] I420, on the host
        self._idle_bytes = 0  # kept and being rendered
        self._encode_processes = encode_processes or max(1, (os.cpu_count() or 2) - 2)
        self.encode_pool: EncodePool | None = None
        self._pool_lock = threading.Lock()
        self._swap: tuple[StepEngine, dict[int, float], threading.Event] | None = None  # for the core thread

    @property
    def step_s(self) -> dict[int, float]:
        """What a step of each bucket took when measured at start."""
        return self.scheduler.step_s

    # --- set-up ---------------------------------------------------------------------------------

    def add_avatar(self, avatar: Avatar | str | Path) -> int:
        """Keep an avatar resident (a compiled avatar folder or a loaded one); returns its index."""
        if not isinstance(avatar, Avatar):
            avatar = load_avatar(avatar, self.device, vae_fingerprint=self.m.fingerprints.get("vae"))
        with self._lock:
            index = self.engine.add_avatar(avatar)
        avatar.wait_frames(1)
        self._rest0[index] = avatar.frames[0].cpu().numpy()
        if self._thread is not None:
            self.runner.warm_sizes()
            self._keep_idle_loop(index)
        return index

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
        marks = [time.perf_counter()]

        def mark(name: str) -> None:  # where a start's time goes (the server's "ready" event reports it)
            marks.append(time.perf_counter())
            self.start_phases[name] = round(marks[-1] - marks[-2], 2)

        self.whisper.idle_window()
        if self.o.features == "stream":
            self.whisper.warm()
        mark("whisper_s")
        self.engine.warm_up()
        mark("capture_and_compile_s")
        self.runner.warm_sizes()
        self.scheduler.step_s.update(self.runner.measure())
        if self.capacity_fps is None:
            self.capacity_fps = self.scheduler.capacity_fps()
        mark("measure_s")
        log.info("live engine: steps %s s, capacity %.0f frames/s",
                 {b: round(s, 4) for b, s in self.step_s.items()}, self.capacity_fps)
        if self.o.encode:
            self._encoders()
        mark("encoders_s")
        self._thread = threading.Thread(target=self._run, name="lipstream-live-core", daemon=True)
        self._thread.start()
        for f in [self._keep_idle_loop(index) for index in range(len(self.engine.avatars))]:
            if f is not None:
                f.result()  # started means warm: idle sessions cost no step from the first frame
        mark("idle_loops_s")
        return self

    def use_compiled(self, compiled: CompiledNetworks, timeout_s: float = 60.0) -> dict[int, float]:
        """Move the frame steps onto ahead-of-time packages while the engine runs (a server that started
        before its packages were built): returns the new steps' measured seconds per bucket.

        The new engine is made, captured and measured here, beside the running one (so with sessions live the
        measure is pessimistic, and capacity errs low); the core thread then takes it between two steps,
        with nothing in flight. Sessions, their features and the idle loops carry on unchanged."""
        engine = PackageEngine(compiled, EngineOptions(batch=self.engine.buckets[-1], decode_rows=self._decode_rows),
                                buckets=self.engine.buckets)
        with self._lock:
            resident = list(self.engine.avatars)
        for a in resident:
            engine.add_avatar(a)
        with torch.inference_mode():
            engine.warm_up()
            probe = StepRunner(engine, self.table)
            probe.warm_sizes()
            step_s = probe.measure()
        if self._thread is None:  # not started: nothing runs yet
            self._take(engine, step_s)
            return step_s
        taken = threading.Event()
        with self._lock:
            for a in self.engine.avatars[len(resident):]:  # added meanwhile
                engine.add_avatar(a)
            self._swap = (engine, step_s, taken)
        self._wake.set()
        if not taken.wait(timeout_s):
            raise RuntimeError(f"the live engine's core did not take the compiled steps within {timeout_s} s")
        self._raise_error()
        return step_s

    def _take(self, engine: StepEngine, step_s: dict[int, float]) -> None:
        self.engine = self.runner.engine = engine
        self.runner.warm_sizes()
        self.scheduler.step_s.update(step_s)
        if self.o.capacity_fps is None:
            self.capacity_fps = self.scheduler.capacity_fps()
        log.info("live engine: on the compiled packages, steps %s s, capacity %.0f frames/s",
                 {b: round(s, 4) for b, s in step_s.items()}, self.capacity_fps or 0)

    def _keep_idle_loop(self, avatar: int) -> Future | None:
        """Render the idle loop of the avatar (offline lane) and keep it, if it fits idle_cache_gib."""
        a = self.engine.avatars[avatar]
        w, h = a.size
        size = a.num_frames * (h * 3 // 2) * w
        if self._idle_bytes + size > self.o.idle_cache_gib * 2**30:
            log.info("live engine: avatar %d's idle loop (%.0f MiB) does not fit idle_cache_gib; rendered live",
                     avatar, size / 2**20)
            return None
        self._idle_bytes += size
        window = self.table.table[self.table.idle].reshape(1, -1, self.table.table.shape[-1])
        future = self.render_offline(avatar, list(range(a.num_frames)), window.expand(a.num_frames, -1, -1))

        def keep(f: Future) -> None:
            if f.exception() is None:
                loop = f.result()
                loop.flags.writeable = False
                self.idle_loops[avatar] = loop

        future.add_done_callback(keep)
        return future

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

    def room(self) -> tuple[float | None, int]:
        """(frames/s another session may still take: None when admission has no capacity figure, session
        places free): what a fleet routes new sessions by."""
        with self._lock:
            places = len(self._free_rings)
            if self.capacity_fps is None:
                return None, places
            load = sum(float(s.fps) for s in self.sessions.values())
            return max(0.0, self.o.utilisation * self.capacity_fps - load), places

    def avatar_index(self, avatar: int | str) -> int:
        """A resident avatar's index from its index or its name."""
        if isinstance(avatar, str):
            names = [a.name for a in self.engine.avatars]
            if avatar not in names:
                raise ValueError(f"avatar: {avatar!r} is not resident; resident: {', '.join(names) or 'none'}")
            return names.index(avatar)
        return int(avatar)

    def open_session(self, avatar: int | str = 0, *, fps: Fraction | float | None = None, encode: bool | None = None,
                     start_frame: int = 0, playout_delay_s: float | None = None) -> Session:
        """A new session on a resident avatar (its index or name), idle until speech is pushed;
        SessionRefused (503) if full. `encode` (None: the engine's `LiveOptions.encode`): H.264 + audio
        packets with each frame, for a WebRTC sender; the integrations, which hand out pictures, pass
        False. `playout_delay_s` (None: the engine's) is this session's own: a client may trade latency
        for fewer late frames; the scheduler orders every frame by its own session's deadline.
        Close it with `session.close()` (or `with`)."""
        self._raise_error()
        avatar = self.avatar_index(avatar)
        if playout_delay_s is not None and not 0.05 <= playout_delay_s <= 5:
            raise ValueError(f"playout_delay_s: {playout_delay_s:g}; 0.05 to 5 s is allowed")
        if not 0 <= avatar < len(self.engine.avatars):
            raise ValueError(f"avatar: index {avatar}; {len(self.engine.avatars)} avatars are resident")
        a = self.engine.avatars[avatar]
        fps = Fraction(fps if fps is not None else a.fps).limit_denominator(1001)
        if not 1 <= fps <= 60:
            raise ValueError(f"fps: {float(fps):g}; 1 to 60 is allowed")
        with self._lock:
            why = admission(list(self.sessions.values()), fps, self.capacity_fps, self.o.utilisation,
                            len(self._free_rings))
            if why is not None:
                raise SessionRefused(503, why)
            ring = self._free_rings.pop()
            sid = self._next_id
            self._next_id += 1
        try:
            rest = self._rest_frame(avatar, int(ping_pong(start_frame, a.num_frames)))  # before frame 0 is ready
            o = self.o if playout_delay_s is None else self.o.replace(playout_delay_s=playout_delay_s)
            session = self._new_session(sid, ring, avatar, fps, o, rest, start_frame)
            if self.o.encode if encode is None else encode:
                w, h = a.size
                handoff = session.handoff
                handoff.attach_encoder(self._encoders().open(
                    w, h, fps, audio=self.o.audio_codec, x264_preset=self.o.x264_preset, crf=self.o.crf,
                    gop_frames=max(1, round(self.o.gop_s * float(fps))), matrix=a.meta.get("colour_matrix", "bt601"),
                    on_packets=handoff.encoded, on_error=handoff.encoder_failed))
        except BaseException:
            with self._lock:
                self._free_rings.append(ring)  # its rows go back
            raise
        with self._lock:
            self.sessions[sid] = session
        self._wake.set()
        return session

    def _rest_frame(self, avatar: int, frame: int) -> np.ndarray:
        """A loop frame on the host, for a session's first picture. Frame 0 is copied once, on the
        thread that added the avatar: the callers' threads make no CUDA call, so a library that changes
        their current CUDA context (LiveKit's FFI does, livekit/rust-sdks#712) cannot break the engine."""
        if frame == 0 and avatar in self._rest0:
            return self._rest0[avatar].copy()
        a = self.engine.avatars[avatar]
        a.wait_frames(frame + 1)
        return a.frames[frame].cpu().numpy().copy()

    def _new_session(self, sid: int, ring: int, avatar: int, fps: Fraction, o: LiveOptions, rest: np.ndarray,
                     start_frame: int) -> Session:
        """A session's three parts, wired to each other and to this engine's threads."""
        a = self.engine.avatars[avatar]
        clock = SessionClock(time.monotonic(), o.playout_delay_s, fps)
        request = SpeechRequest(sid, ring, avatar, a.fps, a.num_frames, start_frame, clock, o, self.table)
        playout: Playout | None = None

        def to_playout(kind: str, generation: int, item: object) -> None:
            playout.arrive(kind, generation, item)

        handoff = FrameHandoff(sid, clock, request.first_step, request.frame_audio, to_playout, self._copy.submit,
                               time.monotonic)
        playout = Playout(clock, request, rest, handoff.want_keyframe, time.monotonic)
        return Session(request, handoff, playout, o, a.size, self._wake.set, time.monotonic,
                       matrix=a.meta.get("colour_matrix", "bt601"), release=self._release)

    def _encoders(self) -> EncodePool:
        with self._pool_lock:  # not the core's lock: starting the processes takes a moment
            if self.encode_pool is None:
                self.encode_pool = EncodePool(self._encode_processes)
            return self.encode_pool

    def close_session(self, session: Session) -> None:
        """The same as session.close(): its stream ends and its place is freed."""
        session.close()

    def _release(self, session: Session) -> None:
        with self._lock:
            if self.sessions.pop(session.id, None) is not None:
                self._free_rings.append(session.request.ring)

    def render_offline(self, avatar: int, frames: list[int], windows: torch.Tensor, *, out: np.ndarray | None = None,
                       rows: list[int] | None = None) -> Future:
        """Offline frames through the same steps at lower priority: loop frames of a resident avatar
        with their windows [n, 50, 384]. The future's result: [n, H*3/2, W] uint8 I420, or `out` (the
        caller's buffer, frame i at row `rows[i]`) with the frames in it. Cancel the future to drop the
        frames not yet rendered."""
        if len(windows) != len(frames):
            raise ValueError("one window per frame")
        w, h = self.engine.avatars[avatar].size
        if out is None:
            out, rows = np.empty((len(frames), h * 3 // 2, w), np.uint8), None
        elif out.shape[1:] != (h * 3 // 2, w) or out.dtype != np.uint8:
            raise ValueError(f"out {tuple(out.shape)} {out.dtype}: [n, {h * 3 // 2}, {w}] uint8 is needed")
        rows = list(range(len(frames))) if rows is None else list(rows)
        if len(rows) != len(frames) or (rows and not 0 <= min(rows) <= max(rows) < len(out)):
            raise ValueError("one row of out per frame")
        job = OfflineJob(avatar, list(frames), windows.to(self.device, self.m.dtype), out, rows)
        if not frames:
            job.future.set_result(out)
            return job.future
        with self._lock:
            self.scheduler.add_offline(job)
        self._wake.set()
        return job.future

    def failed(self) -> bool:
        """The core thread stopped on an error (every session has ended with it)."""
        return self._error is not None

    def _raise_error(self) -> None:
        if self._error is not None:
            raise RuntimeError("the live engine's core stopped") from self._error

    # --- the core thread ------------------------------------------------------------------------

    def _run(self) -> None:
        inflight: InFlight | None = None
        last_turn = features_at = 0.0
        try:
            with torch.inference_mode():
                while not self._stop.is_set():
                    if self._swap is not None:  # new steps (use_compiled): taken with nothing in flight
                        if inflight is not None:
                            self._finish(inflight)
                            inflight = None
                        with self._lock:
                            engine, step_s, taken = self._swap
                            self._take(engine, step_s)
                            self._swap = None
                        taken.set()
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
                        plan = self.scheduler.plan(sessions, now, self.idle_loops)
                        launched = self._launch(plan) if len(plan) else None
                    self.runner.hand_out_cached(plan, self.idle_loops, now)
                    self.stats.idle_cached_frames += len(plan.cached)
                    if inflight is not None:
                        self._finish(inflight)
                    inflight = launched
                    if inflight is not None and inflight.done is None:  # no GPU: the step already ran
                        self._finish(inflight)
                        inflight = None
                    if inflight is None:
                        wait = FILL_POLL_S if plan.deferred else self.scheduler.idle_wait(
                            sessions, time.monotonic(), self.idle_loops)
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
            self.scheduler.fail_offline(RuntimeError("the live engine's core stopped"))

    def _features(self, sessions: list[Session]) -> int:
        """Encode every window that can be now (stream), or whole ended utterances; how many."""
        jobs, whole = [], 0
        for s in sessions:
            if self.o.features == "stream":
                jobs += s.request.window_jobs()
            else:
                for audio, rows in s.request.whole_utterances():
                    feats = whisper_features(torch.from_numpy(audio), self.m)
                    index = torch.tensor(rows[:len(feats)], device=self.device)
                    self.table.table.index_copy_(0, index, feats[:len(rows)].to(self.table.table.dtype))
                    whole += 1
        if jobs:
            self.stats.whisper_runs += self.whisper.run(jobs)
            self.stats.whisper_windows += len(jobs)
        return len(jobs) + whole

    def _launch(self, plan) -> InFlight:
        inflight = self.runner.launch(plan)
        self.stats.steps += 1
        n = len(plan)
        self.stats.batch_sizes[n] = self.stats.batch_sizes.get(n, 0) + 1
        return inflight

    def _finish(self, f: InFlight) -> None:
        took = self.runner.finish(f)
        if f.timing is not None:
            self.stats.gpu_busy_s += took
        self.scheduler.observe_step(took)
        self.stats.frames += len(f.plan.live)
        self.stats.offline_frames += len(f.plan.offline)


def start_engine(avatars: list[str | Path], *, models: str | Path | None = None, random_weights: bool = False,
                 size: str = "full", device: str = "auto", options: LiveOptions | str = "realtime",
                 inductor: str = "off") -> LiveEngine:
    """A started LiveEngine with these compiled avatar folders resident: what an integration's host
    process makes once and shares between its pipelines. `models`: the MuseTalk folder (None: the
    default place, models.layout); `random_weights` (with `size`) for tests and benchmarks only, never
    passed off as real. Close it with `close()` (or `with`)."""
    from lipstream.models import load_musetalk
    from lipstream.engine.networks import pick_device

    folders = [Path(a) for a in avatars]
    for folder in folders:
        if not (folder / "avatar.json").is_file():
            raise ValueError(f"avatars: {folder} is not a compiled avatar folder (`lipstream compile VIDEO`)")
    m = load_musetalk(models, device=pick_device(device), random_weights=random_weights, size=size, warn=False)
    live = LiveEngine(m, options, inductor=inductor)
    try:
        for folder in folders:
            live.add_avatar(folder)
        return live.start()
    except BaseException:
        live.close()
        raise
