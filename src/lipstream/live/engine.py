"""The live engine's front end: what callers use (vLLM's engine front end over its EngineCore).

Avatars made resident, sessions opened (admitted by the engine's measured capacity), closed and freed,
offline frames (a server's render jobs, the idle loops) queued at lower priority, and the start: every
bucket captured, a step's cost measured, the encoders and the core's thread started, the idle loops
rendered. The core (live/core.py) steps the GPU on its own thread: features -> schedule -> launch ->
finish. A session's state is its own (live/session.py: request | hand-off | playout); sessions copy
their frames out on the core's copy threads and encode them in worker processes (media.EncodePool),
off this process's GIL; idle frames come from each avatar's idle loop, rendered once at start.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from lipstream.avatar import Avatar, load_avatar, ping_pong
from lipstream.engine.engines import ModuleEngine, PackageEngine, StepEngine
from lipstream.engine.options import EngineOptions
from lipstream.live.core import EngineStats, LiveCore
from lipstream.live.handoff import FrameHandoff
from lipstream.live.interface import SessionRefused
from lipstream.live.items import SessionClock
from lipstream.live.options import SESSION_LATENCY, LiveOptions, preset
from lipstream.live.playout import Playout
from lipstream.live.request import SpeechRequest
from lipstream.live.runner import StepRunner
from lipstream.live.scheduler import OfflineJob, admission, step_budget_s
from lipstream.live.session import Session
from lipstream.media.encode_pool import EncodePool

if TYPE_CHECKING:
    from lipstream.engine.aot import CompiledNetworks
    from lipstream.models import MuseTalk

log = logging.getLogger(__name__)
COMPILED_FROM = 8  # Inductor (when asked) for the buckets of this many frames and up


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
            engine: StepEngine = PackageEngine(compiled, EngineOptions(batch=buckets[-1], decode_rows=decode_rows),
                                               buckets=buckets)
        else:
            engine = ModuleEngine(models, EngineOptions(batch=buckets[-1], decode_rows=decode_rows, inductor=inductor),
                                  buckets=buckets,
                                  compile_buckets=tuple(b for b in buckets if b >= COMPILED_FROM) or (buckets[-1],))
        self.core = LiveCore(models, engine, self.o)
        self._free_rings = list(range(self.o.max_sessions))[::-1]  # each session's rows of the feature table
        self._next_id = 0
        self.capacity_fps = self.o.capacity_fps
        self.start_phases: dict[str, float] = {}  # seconds of each step of start()
        self._rest0: dict[int, np.ndarray] = {}  # avatar -> its loop frame 0 on the host (a session's first picture)
        self._idle_bytes = 0  # idle loops kept and being rendered
        self._encode_processes = encode_processes or max(1, (os.cpu_count() or 2) - 2)
        self.encode_pool: EncodePool | None = None  # started with the first encoded session
        self._pool_lock = threading.Lock()

    # what callers and the server read of the core
    @property
    def engine(self) -> StepEngine:
        """The FrameEngine the core steps (another once `use_compiled` has moved it onto the packages)."""
        return self.core.engine

    @property
    def sessions(self) -> dict[int, Session]:
        return self.core.sessions

    @property
    def stats(self) -> EngineStats:
        return self.core.stats

    @property
    def idle_loops(self) -> dict[int, np.ndarray]:
        return self.core.idle_loops

    @property
    def step_s(self) -> dict[int, float]:
        """What a step of each bucket took when measured at start."""
        return self.core.scheduler.step_s

    # --- set-up ---------------------------------------------------------------------------------

    def add_avatar(self, avatar: Avatar | str | Path) -> int:
        """Keep an avatar resident (a compiled avatar folder or a loaded one); returns its index."""
        if not isinstance(avatar, Avatar):
            avatar = load_avatar(avatar, self.device, vae_fingerprint=self.m.fingerprints.get("vae"))
        with self.core.lock:
            index = self.core.engine.add_avatar(avatar)
        avatar.wait_frames(1)
        self._rest0[index] = avatar.frames[0].cpu().numpy()
        if self.core.running:
            self.core.runner.warm_sizes()
            self._keep_idle_loop(index)
        return index

    def start(self) -> LiveEngine:
        """Capture every bucket, measure what a step costs, then start the core thread."""
        if self.core.running:
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

        core = self.core
        core.whisper.idle_window()
        if self.o.features == "stream":
            core.whisper.warm()
        mark("whisper_s")
        self.engine.warm_up()
        mark("capture_and_compile_s")
        core.runner.warm_sizes()
        core.scheduler.step_s.update(core.runner.measure())
        if self.capacity_fps is None:
            self.capacity_fps = core.scheduler.capacity_fps()
        mark("measure_s")
        log.info("live engine: steps %s s, capacity %.0f frames/s",
                 {b: round(s, 4) for b, s in self.step_s.items()}, self.capacity_fps)
        if self.o.encode:
            self._encoders()
        mark("encoders_s")
        core.start()
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
        with self.core.lock:
            resident = list(self.engine.avatars)
        for a in resident:
            engine.add_avatar(a)
        with torch.inference_mode():
            engine.warm_up()
            probe = StepRunner(engine, self.core.table)
            probe.warm_sizes()
            step_s = probe.measure()
        self.core.take_engine(engine, step_s, timeout_s)
        self._raise_error()
        if self.o.capacity_fps is None:
            self.capacity_fps = self.core.scheduler.capacity_fps()
        log.info("live engine: on the compiled packages, steps %s s, capacity %.0f frames/s",
                 {b: round(s, 4) for b, s in step_s.items()}, self.capacity_fps or 0)
        return step_s

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
        table = self.core.table
        window = table.table[table.idle].reshape(1, -1, table.table.shape[-1])
        future = self.render_offline(avatar, list(range(a.num_frames)), window.expand(a.num_frames, -1, -1),
                                     idle_loop=True)

        def keep(f: Future) -> None:
            if f.exception() is None:
                loop = f.result()
                loop.flags.writeable = False
                self.idle_loops[avatar] = loop

        future.add_done_callback(keep)
        return future

    def close(self) -> None:
        self.core.stop()
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
        with self.core.lock:
            places = len(self._free_rings)
            if self.capacity_fps is None:
                return None, places
            load = sum(float(s.fps) for s in self.sessions.values())
            tight = self._tightest(self.o)  # a low-latency session open keeps every step short
            capacity = self.capacity_fps if tight is None else min(self.capacity_fps, tight[1] or 0.0)
            return max(0.0, self.o.utilisation * capacity - load), places

    def avatar_index(self, avatar: int | str) -> int:
        """A resident avatar's index from its index or its name."""
        if isinstance(avatar, str):
            names = [a.name for a in self.engine.avatars]
            if avatar not in names:
                raise ValueError(f"avatar: {avatar!r} is not resident; resident: {', '.join(names) or 'none'}")
            return names.index(avatar)
        return int(avatar)

    def open_session(self, avatar: int | str = 0, *, fps: Fraction | float | None = None, encode: bool | None = None,
                     start_frame: int = 0, playout_delay_s: float | None = None,
                     latency: str | None = None) -> Session:
        """A new session on a resident avatar (its index or name), idle until speech is pushed;
        SessionRefused (503) if full. `encode` (None: the engine's `LiveOptions.encode`): H.264 + audio
        packets with each frame, for a WebRTC sender; the integrations, which hand out pictures, pass
        False. `playout_delay_s` (None: the engine's) is this session's own: a client may trade latency
        for fewer late frames; the scheduler orders every frame by its own session's deadline.
        `latency` ("default" or None: the engine's options): "low" takes the `lowlatency` preset's delay
        and window (docs/live.md, "Low latency"); `playout_delay_s` goes over it.
        Close it with `session.close()` (or `with`)."""
        self._raise_error()
        avatar = self.avatar_index(avatar)
        if playout_delay_s is not None and not 0.05 <= playout_delay_s <= 5:
            raise ValueError(f"playout_delay_s: {playout_delay_s:g}; 0.05 to 5 s is allowed")
        if latency is not None and latency not in SESSION_LATENCY:
            raise ValueError(f"latency: {latency!r}; {' or '.join(map(repr, SESSION_LATENCY))} is allowed")
        if not 0 <= avatar < len(self.engine.avatars):
            raise ValueError(f"avatar: index {avatar}; {len(self.engine.avatars)} avatars are resident")
        a = self.engine.avatars[avatar]
        fps = Fraction(fps if fps is not None else a.fps).limit_denominator(1001)
        if not 1 <= fps <= 60:
            raise ValueError(f"fps: {float(fps):g}; 1 to 60 is allowed")
        o = self.o if latency is None else self.o.replace(**SESSION_LATENCY[latency])
        o = o if playout_delay_s is None else o.replace(playout_delay_s=playout_delay_s)
        with self.core.lock:
            why = admission(list(self.sessions.values()), fps, self.capacity_fps, self.o.utilisation,
                            len(self._free_rings), self._tightest(o))
            if why is not None:
                raise SessionRefused(503, why)
            ring = self._free_rings.pop()
            sid = self._next_id
            self._next_id += 1
        try:
            rest = self._rest_frame(avatar, int(ping_pong(start_frame, a.num_frames)))  # before frame 0 is ready
            session = self._new_session(sid, ring, avatar, fps, o, rest, start_frame)
            if self.o.encode if encode is None else encode:
                w, h = a.size
                handoff = session.handoff
                handoff.attach_encoder(self._encoders().open(
                    w, h, fps, audio=self.o.audio_codec, x264_preset=self.o.x264_preset, crf=self.o.crf,
                    gop_frames=max(1, round(self.o.gop_s * float(fps))), matrix=a.meta.get("colour_matrix", "bt601"),
                    on_packets=handoff.encoded, on_error=handoff.encoder_failed))
        except BaseException:
            with self.core.lock:
                self._free_rings.append(ring)  # its rows go back
            raise
        with self.core.lock:
            self.sessions[sid] = session
        self.core.wake.set()
        return session

    def _tightest(self, o: LiveOptions) -> tuple[float, float | None] | None:
        """With the capacity measured (not given): the shortest playout delay of the open sessions and one of
        options `o`, and what steps short enough for it make a second (admission())."""
        steps = self.core.scheduler
        if self.o.capacity_fps is not None or not steps.step_s:
            return None
        tight = min([o, *(s.o for s in self.sessions.values())], key=step_budget_s)
        return tight.playout_delay_s, steps.capacity_within(step_budget_s(tight))

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
        request = SpeechRequest(sid, ring, avatar, a.fps, a.num_frames, start_frame, clock, o, self.core.table)
        playout: Playout | None = None

        def to_playout(kind: str, generation: int, item: object) -> None:
            playout.arrive(kind, generation, item)

        handoff = FrameHandoff(sid, clock, request.first_step, request.frame_audio, to_playout, self.core.copy.submit,
                               time.monotonic, o.window_ahead_steps)
        playout = Playout(clock, request, rest, handoff.want_keyframe, time.monotonic)
        return Session(request, handoff, playout, o, a.size, self.core.wake.set, time.monotonic,
                       matrix=a.meta.get("colour_matrix", "bt601"), release=self._release, switch=self._switch)

    def _switch(self, session: Session, avatar: int | str) -> int:
        """Session.switch: checked here, where the avatars are; the cut is the session's request's."""
        index = self.avatar_index(avatar)
        if not 0 <= index < len(self.engine.avatars):
            raise ValueError(f"avatar: index {index}; {len(self.engine.avatars)} avatars are resident")
        a = self.engine.avatars[index]
        if tuple(a.size) != tuple(session.size):
            raise ValueError(f"avatar: {a.name!r} is {a.size[0]}x{a.size[1]}; a cut keeps the session's frame size, "
                             f"{session.size[0]}x{session.size[1]}")
        matrix = a.meta.get("colour_matrix", "bt601")
        if matrix != session.matrix:
            raise ValueError(f"avatar: {a.name!r} is in the {matrix} colour matrix; a cut keeps the session's, "
                             f"{session.matrix}")
        frame = session.request.cut(index, a.fps, a.num_frames, time.monotonic(), session.handoff.rewind)
        self.core.wake.set()
        return frame

    def _encoders(self) -> EncodePool:
        with self._pool_lock:  # not the core's lock: starting the processes takes a moment
            if self.encode_pool is None:
                self.encode_pool = EncodePool(self._encode_processes)
            return self.encode_pool

    def close_session(self, session: Session) -> None:
        """The same as session.close(): its stream ends and its place is freed."""
        session.close()

    def _release(self, session: Session) -> None:
        with self.core.lock:
            if self.sessions.pop(session.id, None) is not None:
                self._free_rings.append(session.request.ring)

    def render_offline(self, avatar: int, frames: list[int], windows: torch.Tensor, *, out: np.ndarray | None = None,
                       rows: list[int] | None = None, idle_loop: bool = False) -> Future:
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
        job = OfflineJob(avatar, list(frames), windows.to(self.device, self.m.dtype), out, rows, idle_loop=idle_loop)
        if not frames:
            job.future.set_result(out)
            return job.future
        with self.core.lock:  # the core fails what it holds under this lock when it stops: nothing waits forever
            self._raise_error()
            self.core.scheduler.add_offline(job)
        self.core.wake.set()
        return job.future

    def failed(self) -> bool:
        """The core thread stopped on an error (every session has ended with it)."""
        return self.core.error is not None

    def _raise_error(self) -> None:
        if self.core.error is not None:
            raise RuntimeError("the live engine's core stopped") from self.core.error


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
