"""LiveKit load: N LipStream VideoGenerators on one engine in one process, each under LiveKit's own AvatarRunner.

Each generator runs as in `start_in_process`: a QueueAudioOutput (the agent's audio output) feeds a
real AvatarRunner, whose real AVSynchronizer paces the pictures and plays the audio into a real
(FFI) AudioSource; the room is `RoomWithoutServer` (publishing goes nowhere: no WebRTC encode or
network, which a LiveKit server adds per room). Speech comes as a TTS hands it over, in real time:
20 ms rtc.AudioFrames at 24 kHz, utterances of 2-5 s, pauses of 0.5-1.5 s, a flush after each.

What the runner pushes into its synchronizer is recorded in order; per generator over a window of
`seconds` (after SETTLE_S for the staggered starts and the playout delay, before which a session
has no picture): video fps, frames late (session.stats), misaligned audio (a speaking picture
not followed by exactly its audio, or audio after anything else), the intervals between pictures
(p99, max); `errors`: generators that failed (their fps counts as 0). `run` measures one N (the
row benchmarks/integrations.py reads); `python -m lipstream.bench.livekit_load` runs several on a
fresh engine (720p25 by default) and prints a JSON row per N.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import threading
import time
import traceback
from fractions import Fraction

import numpy as np
from livekit import rtc
from livekit.agents.voice.avatar import AvatarRunner, QueueAudioOutput

from lipstream.bench.livekit_room import TTS_RATE, RoomTracks, RoomWithoutServer
from lipstream.bench.proc import CoresUsed, cores_of_processes, rows_of_processes, tell_tasks_after
from lipstream.fixtures import speech_like
from lipstream.integrations.livekit import LipStreamVideoGenerator
from lipstream.live import LiveEngine

SETTLE_S = 1.0  # runners start staggered over the first second: left out of every figure
MEDIA_WAIT_S = 60.0  # at most this long for a runner's first picture (a server's handshakes under load)
CHUNK_S = 0.02


class Window:
    """The measured stretch [since, until) (time.monotonic()), set once every runner is running: setting up
    (opening a session, a room's sources, the first pictures) is left out of the figures."""

    def __init__(self) -> None:
        self.since = self.until = math.inf
        self.open = asyncio.Event()

    def start(self, since: float, seconds: float) -> None:
        self.since, self.until = since, since + seconds
        self.open.set()


class PushLog:
    """Counts what a runner pushes into its AVSynchronizer (wraps its push) within `window`: cheap per frame."""

    def __init__(self, runner: AvatarRunner, generator: LipStreamVideoGenerator, window: Window):
        self.generator, self.window = generator, window
        self.pictures_seen = 0  # since the runner started, counted or not
        self.picture_times: list[float] = []
        self.speech_pictures = self.misaligned = 0
        self._expect = 0  # samples the last picture's audio must have (0: none may follow)
        push = runner.av_sync.push

        async def logged(frame, timestamp=None):
            self._saw(frame)
            await push(frame, timestamp)

        runner.av_sync.push = logged

    def _saw(self, frame) -> None:
        now = time.monotonic()
        counted = self.window.since <= now < self.window.until
        if isinstance(frame, rtc.VideoFrame):
            self.pictures_seen += 1
            if self._expect and counted:
                self.misaligned += 1  # the previous speaking picture came without its audio
            last = self.generator.last_frame
            self._expect = last.audio.size if last is not None and last.utterance is not None else 0
            if counted:
                self.picture_times.append(now)
                self.speech_pictures += self._expect > 0
        else:
            if counted and frame.samples_per_channel != self._expect:
                self.misaligned += 1  # audio after an idle picture, or not the picture's own
            self._expect = 0


async def _feed(audio: QueueAudioOutput, rng: np.random.Generator, speech: np.ndarray, until: float) -> None:
    step = round(TTS_RATE * CHUNK_S)
    while time.monotonic() < until - 1.0:
        await asyncio.sleep(rng.uniform(0.5, 1.5))
        start = int(rng.integers(0, speech.size - 5 * TTS_RATE))
        clip = speech[start:start + int(rng.uniform(2.0, 5.0) * TTS_RATE)]
        t0 = time.monotonic()
        for k, i in enumerate(range(0, clip.size, step)):
            await asyncio.sleep(max(0.0, t0 + k * CHUNK_S - time.monotonic()))
            chunk = clip[i:i + step]
            await audio.capture_frame(rtc.AudioFrame(chunk.tobytes(), TTS_RATE, 1, chunk.size))
            if time.monotonic() > until:
                break
        audio.flush()


async def _one(session, index: int, n: int, window: Window, ready: asyncio.Event, size: tuple[int, int] | None,
               speech: np.ndarray, opened: float, opening_s: float) -> dict:
    """One generator over an open `session` (opened at `opened`, time.monotonic(), after `opening_s`) under its
    runner: set up, `ready` set once its first picture is pushed, then fed speech until the window closes; its
    figures over the window, and how long each step of its set-up took."""
    setup = {"sessions_opened_s": round(opening_s, 3)}  # connect(): the offer and answer, for every session
    try:
        await asyncio.sleep(index * SETTLE_S / n)  # staggered over the first second
        t = time.monotonic()
        generator = LipStreamVideoGenerator(session, size=size)
        audio = QueueAudioOutput()
        runner = AvatarRunner(RoomWithoutServer(), audio_recv=audio, video_gen=generator,
                              options=generator.avatar_options())
        log = PushLog(runner, generator, window)
        setup["runner_made_s"] = round(time.monotonic() - t, 3)
        t = time.monotonic()
        await runner.start()
        setup["runner_started_s"] = round(time.monotonic() - t, 3)
    except BaseException:
        ready.set()
        raise
    try:
        t = time.monotonic() + MEDIA_WAIT_S
        while not log.pictures_seen and time.monotonic() < t:
            await asyncio.sleep(0.02)
        setup["first_picture_after_open_s"] = round(time.monotonic() - opened, 3) if log.pictures_seen else None
        ready.set()
        await window.open.wait()
        await _feed(audio, np.random.default_rng(index), speech, window.until)
        await asyncio.sleep(max(0.0, window.until - time.monotonic()))
        actual_fps = runner.av_sync.actual_fps
    finally:
        ready.set()
        await runner.aclose()
    stats = session.stats
    times = np.asarray(log.picture_times)
    gaps = np.diff(times) * 1000 if times.size > 1 else np.zeros(1)
    since, seconds = window.since, window.until - window.since
    span = [round(float(times[0]) - since, 2), round(float(times[-1]) - since, 2)] if times.size else None
    return {"pictures": int(times.size), "fps": round(times.size / seconds, 2), "synchronizer_fps": round(actual_fps, 2),
            "setup": setup, "ended_by_server": getattr(session, "error", None),
            "pictures_from_to_s": span,
            "speech_pictures": log.speech_pictures, "misaligned": log.misaligned, "late": stats.late,
            "late_speech": stats.late_speech, "interval_p99_ms": round(float(np.percentile(gaps, 99)), 1),
            "interval_max_ms": round(float(gaps.max()), 1), "_gaps": gaps}


def run(engine: LiveEngine | None, avatar: int | str, n: int, seconds: float, size: tuple[int, int] | None = None,
        fps: float = 25, *, url: str | None = None, api_key: str | None = None, start_at: float | None = None) -> dict:
    """N generators measured over `seconds` after they have all started: one row of the report. Their
    sessions are on `engine` (a started LiveEngine in this process), or (`url`) on the `lipstream serve`
    there, each a WebRTC client here (frames late: counted at the client). `start_at` (time.time()):
    when to start (rooms in processes of their own start together)."""
    if not 1 <= n <= 256 or seconds <= 0:
        raise ValueError(f"n: {n}, seconds: {seconds}; 1 to 256 generators and more than 0 s are allowed")
    if (engine is None) == (url is None):
        raise ValueError("engine, url: exactly one is allowed")
    speech = (speech_like(12.0, TTS_RATE, seed=7) * 20000).astype(np.int16)
    rate = Fraction(fps).limit_denominator(1001)

    async def opener():
        if url is None:
            return engine.open_session(avatar, fps=rate, encode=False)
        from lipstream.client import connect

        return await connect(url, str(avatar), api_key=api_key, fps=rate)

    stall, running_stall = LoopStall(), LoopStall()
    cores, used = CoresUsed(), {}  # this process's CPU (runners, synchronizers, WebRTC clients) over the window

    tracks_made_s = None

    async def main() -> list:
        nonlocal tracks_made_s
        if start_at is not None:  # a room process: where it waits, should it outlive its parent's patience
            tell_tasks_after(max(0.0, start_at - time.time()) + seconds + ROOM_TELL_S)
        stall.start()
        t = time.monotonic()
        tracks = RoomTracks(n)  # the runners' tracks, made before any session opens (see RoomTracks)
        tracks_made_s = round(time.monotonic() - t, 3)
        sessions: list = []
        try:  # LiveKit's track makers are given back whatever happens
            t = time.monotonic()
            sessions = await asyncio.gather(*(opener() for _ in range(n)), return_exceptions=True)
            opened = time.monotonic()
            window, ready = Window(), [asyncio.Event() for _ in sessions]
            runs = asyncio.gather(*(_one(session, i, n, window, ready[i], size, speech, opened, opened - t)
                                    if not isinstance(session, BaseException) else _failed(session)
                                    for i, session in enumerate(sessions)), return_exceptions=True)
            for i, session in enumerate(sessions):
                if isinstance(session, BaseException):
                    ready[i].set()
            await asyncio.gather(*(r.wait() for r in ready))  # every runner has pushed its first picture
            if start_at is not None:  # rooms in processes of their own: the window opens at one moment
                await asyncio.sleep(max(0.0, start_at - time.time()))
            stall.stop()
            running_stall.start()
            window.start(time.monotonic() + SETTLE_S, seconds)
            cores.start()
            done = await runs
            used.update(cores.stop())
            return done
        finally:
            running_stall.stop()
            tracks.close()
            await asyncio.gather(*(s.aclose() for s in sessions if not isinstance(s, BaseException)),
                                 return_exceptions=True)

    row = _row(asyncio.run(main()), n, seconds, fps, keep_gaps=start_at is not None)
    row["startup_loop_stall_max_ms"], row["loop_stall_max_ms"] = stall.max_ms(), running_stall.max_ms()
    row.update(used)
    row["startup_loop_stall_where"], row["tracks_made_s"] = stall.where, tracks_made_s
    return row


class LoopStall:
    """The longest this event loop was held up (a 10 ms sleep overran) while sessions opened and runners started:
    a loop held 6 s or more leaves the sessions' WebRTC peers unanswering, and the server closes them. A
    watching thread notes what the loop's thread was running once a stall passes `WHERE_AFTER_S` (`where`:
    the innermost frames, of the longest stall seen)."""

    WHERE_AFTER_S = 0.5

    def __init__(self) -> None:
        self.worst = 0.0
        self.where: list[dict] = []  # the longest stalls: how long (so far), when after start, where
        self._task: asyncio.Task | None = None
        self._tick = time.perf_counter()
        self._stop = threading.Event()

    def start(self) -> None:
        async def watch() -> None:
            while True:
                t = self._tick = time.perf_counter()
                await asyncio.sleep(0.01)
                self.worst = max(self.worst, time.perf_counter() - t - 0.01)

        self._task = asyncio.ensure_future(watch())
        self._started = time.perf_counter()
        loop_thread = threading.get_ident()

        def look() -> None:  # a thread: where the loop's thread is while the loop does not tick
            seen: dict[float, tuple[float, list[str]]] = {}  # each stall (by when it began): its length, where
            while not self._stop.wait(0.1):
                began = self._tick
                held = time.perf_counter() - began
                frame = sys._current_frames().get(loop_thread) if held > self.WHERE_AFTER_S else None
                if frame is not None:
                    seen[began] = (held, [f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                                          for f in traceback.extract_stack(frame) if not f.filename.startswith("<")][-12:])
                    self.where = [{"ms": round(h * 1000), "at_s": round(b - self._started, 2), "where": w}
                                  for b, (h, w) in sorted(seen.items(), key=lambda kv: -kv[1][0])[:3]]

        threading.Thread(target=look, name="loop-stall", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            self._task.cancel()

    def max_ms(self) -> float:
        return round(self.worst * 1000, 1)


async def _failed(error: BaseException) -> dict:
    raise error


def _row(results: list, n: int, seconds: float, fps: float, keep_gaps: bool = False) -> dict:
    """The figures of N generators' results (a dict each, or the exception it failed with). `keep_gaps`:
    each generator's picture intervals stay in its row (a room process hands them to `rooms`)."""
    rows = [r for r in results if isinstance(r, dict)]
    errors = [r for r in results if not isinstance(r, dict)]
    if not rows:
        raise RuntimeError(f"every generator failed: {type(errors[0]).__name__}: {errors[0]}")
    gaps = np.concatenate([r["_gaps"] for r in rows])
    for r in rows:
        held = r.pop("_gaps")
        if keep_gaps:
            r["gaps_ms"] = [round(float(g), 2) for g in held]
    rates = [r["fps"] if isinstance(r, dict) else 0.0 for r in results]
    return {"n": n, "fps_target": fps, "seconds": seconds, "fps_min": min(rates), "fps_median": float(np.median(rates)),
            "late": sum(r["late"] for r in rows), "late_speech": sum(r["late_speech"] for r in rows),
            "misaligned": sum(r["misaligned"] for r in rows), "errors": len(errors),
            "first_error": f"{type(errors[0]).__name__}: {errors[0]}" if errors else None,
            "interval_p99_ms": round(float(np.percentile(gaps, 99)), 1), "interval_max_ms": round(float(gaps.max()), 1),
            "generators": rows}


ROOM_START_S = 25.0  # room processes import LiveKit and connect before they start together
ROOM_TELL_S = 75.0  # a room process still running this long after its window prints its tasks (the parent waits 90)


def rooms(url: str, avatar: str, n: int, seconds: float, size: tuple[int, int] | None = None, fps: float = 25, *,
          api_key: str | None = None) -> dict:
    """N rooms as LiveKit deploys agents, a process per job: N processes of one generator each under its
    AvatarRunner, each session on the `lipstream serve` at `url`, all from one moment; the row of this N
    (`processes_failed`: rooms that reported nothing, their fps counted as 0)."""
    start = time.time() + ROOM_START_S
    common = ["--url", url, "--avatar", avatar, "--sessions", "1", "--seconds", str(seconds), "--fps", str(fps),
              "--start", str(start), *(["--size", f"{size[0]}x{size[1]}"] if size is not None else [])]
    env = {**os.environ, "LIPSTREAM_API_KEY": api_key or os.environ.get("LIPSTREAM_API_KEY", "")}
    results: list = []
    rooms_: list[dict] = []  # each room process's own row
    for row in rows_of_processes("lipstream.bench.livekit_load", [common] * n, ROOM_START_S + seconds + 90, env):
        if isinstance(row, str):
            results.append(RuntimeError(row))
        else:
            results += row["generators"] or [RuntimeError(row["first_error"])]
            rooms_.append(row)
    for r in results:
        if isinstance(r, dict):
            r["_gaps"] = np.asarray(r.pop("gaps_ms"))
    row = _row(results, n, seconds, fps)
    row["processes"], row["processes_failed"] = n, sum(not isinstance(r, dict) for r in results)
    # the worst room's: its event loop's longest stalls while starting and running, and where the first were;
    # and how long making its runners' LiveKit tracks took, before its sessions opened
    worst = max(rooms_, key=lambda r: r.get("startup_loop_stall_max_ms") or 0.0, default={})
    row["startup_loop_stall_max_ms"] = worst.get("startup_loop_stall_max_ms")
    row["startup_loop_stall_where"] = worst.get("startup_loop_stall_where") or []
    row["loop_stall_max_ms"] = max((r.get("loop_stall_max_ms") or 0.0 for r in rooms_), default=None)
    row["tracks_made_s"] = max((r["tracks_made_s"] for r in rooms_ if r.get("tracks_made_s") is not None),
                               default=None)
    row["ended_by_server"] = sorted({r["ended_by_server"] for r in results if isinstance(r, dict) and r["ended_by_server"]})
    row.update(cores_of_processes(rooms_))  # the rooms' own CPU, and how busy the machine they share was
    return row


def holds(row: dict) -> bool:
    """Every generator ran, at the target fps (within 2%), none of its pictures late, every speaking one with its audio."""
    return (row["fps_min"] >= 0.98 * row["fps_target"] and row["late"] == 0 and row["misaligned"] == 0
            and row["errors"] == 0 and not row.get("processes_failed"))


def main(argv: list[str] | None = None) -> None:
    """python -m lipstream.bench.livekit_load --random-weights --sessions 8,16,24 (N generators on an engine
    in this process); --url URL --avatar NAME [--processes]: on a running `lipstream serve` (its key:
    $LIPSTREAM_API_KEY), in this process or a process per room."""
    from pathlib import Path

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--sessions", default="8,16,24")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--size", default=None, help="WxH of the pictures (default: the avatar's; 1280x720 for the avatar "
                                                "made here)")
    p.add_argument("--fps", type=int, default=25)
    p.add_argument("--url", default=None, help="a running lipstream serve: the sessions are its")
    p.add_argument("--avatar", default=None, help="with --url: a resident avatar's name")
    p.add_argument("--processes", action="store_true", help="with --url: a process per room")
    p.add_argument("--start", type=float, default=None, help="time.time() at which to start (a room process)")
    p.add_argument("--out", type=Path, default=None, help="the last row as JSON here")
    p.add_argument("--work", default="livekit-load-work", help="where the generated avatar is kept")
    p.add_argument("--models", default=None)
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--random-size", choices=("full", "tiny"), default="full")
    p.add_argument("--device", default="auto")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto")
    a = p.parse_args(argv)
    counts = [int(v) for v in a.sessions.split(",")]
    size = tuple(int(v) for v in a.size.lower().split("x")) if a.size else None
    if a.url is not None:
        if not a.avatar:
            raise SystemExit("--url: --avatar NAME (a resident avatar of that server) is required")
        key = os.environ.get("LIPSTREAM_API_KEY") or None
        for n in counts:
            row = (rooms(a.url, a.avatar, n, a.seconds, size, a.fps, api_key=key) if a.processes else
                   run(None, a.avatar, n, a.seconds, size, a.fps, url=a.url, api_key=key, start_at=a.start))
            if a.out is not None:
                tmp = a.out.with_suffix(".part")
                tmp.write_text(json.dumps(row))
                tmp.replace(a.out)
            print(json.dumps({**{k: v for k, v in row.items() if k != "generators"}, "holds": holds(row)}), flush=True)
        return
    from lipstream.bench.scenarios import _avatar
    from lipstream.engine.engines import FAST_INDUCTOR
    from lipstream.engine.networks import pick_device
    from lipstream.live import preset
    from lipstream.models import load_musetalk

    w, h = size or (1280, 720)
    sys.setswitchinterval(0.001)  # the runners' event loop shares the GIL with the core thread
    models = load_musetalk(a.models, device=pick_device(a.device), random_weights=a.random_weights,
                           size=a.random_size)
    work = Path(a.work)
    name = f"p{w}x{h}_0"
    if not (work / "avatars" / name).exists():
        work.mkdir(parents=True, exist_ok=True)
        _avatar(work, name, models, w, h, a.fps, 0)
    inductor = FAST_INDUCTOR if a.compile == "on" or (a.compile == "auto" and models.device.type == "cuda") else "off"
    engine = LiveEngine(models, preset("realtime").replace(encode=False, capacity_fps=math.inf,
                                                           max_sessions=max(counts)), inductor=inductor)
    engine.add_avatar(work / "avatars" / name)
    engine.start()
    try:
        run(engine, name, max(counts), 4.0, fps=a.fps)  # warm-up at the largest N, not reported
        for n in counts:
            row = run(engine, name, n, a.seconds, fps=a.fps)
            print(json.dumps({**{k: v for k, v in row.items() if k != "generators"}, "holds": holds(row),
                              "size": f"{w}x{h}"}), flush=True)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
