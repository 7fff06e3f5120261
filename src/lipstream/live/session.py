"""One live session: speech in as it arrives, lip-synced frames out at the avatar's frame rate.

A session keeps a timeline. Frame f plays at `t0 + delay + f / fps` (its deadline). Speech pushed
at wall time t starts at the first frame whose media time `f / fps` is not before `t - t0`, so it
plays `delay` after it was pushed; between utterances the idle loop plays (the mouth at rest).
The engine's core thread asks the session which frames it can render now (`candidates`), takes
some (`take`) and hands them back rendered (`deliver`); the consumer's event loop reads them in
order at their playout times (`async for item in session`), with speech events between them. A
frame not ready at its deadline is replaced by the previous picture and counted (`late`); a
consumer that stops reading loses frames, never stalls the engine. Between `deliver` and the
consumer, frames go through the in-order copy-out and encode handoff (live/handoff.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np
import torch

from lipstream.audio.windows import LEFT_PAD_STEPS
from lipstream.avatar import ping_pong
from lipstream.live.features import MARGIN, WindowJob
from lipstream.live.handoff import FALL_BEHIND_S, TIMING_STAGES, FrameHandoff
from lipstream.live.items import Candidate, LiveFrame, SessionStats, SpeechEvent
from lipstream.live.options import LiveOptions
from lipstream.live.utterance import Utterance
from lipstream.rates import AUDIO_RATE
from lipstream.models.config import FEATURE_RATE, SAMPLES_PER_FEATURE, WINDOW_STEPS

TIMINGS_KEPT = 6000  # speech frames' timings a session keeps (4 minutes at 25 fps)

if TYPE_CHECKING:
    from lipstream.media.encode_pool import PooledEncoder
    from lipstream.media.session_encoder import EncodedPacket
    from lipstream.live.features import FeatureTable

log = logging.getLogger(__name__)


class Session(FrameHandoff):
    """Made by LiveEngine.open_session. Thread-safe: push, end and clear from any thread. Its rendered
    frames reach the encoder and the consumer through FrameHandoff (live/handoff.py)."""

    def __init__(self, sid: int, slot: int, avatar_slot: int, avatar_fps: Fraction, fps: Fraction,
                 size: tuple[int, int], num_loop_frames: int, options: LiveOptions, table: FeatureTable,
                 rest_frame: np.ndarray, wake: Callable[[], None], submit: Callable[[Callable[[], None]], object],
                 start_frame: int = 0, clock: Callable[[], float] = time.monotonic):
        self.id, self.slot, self.avatar, self.fps, self.size = sid, slot, avatar_slot, Fraction(fps), size
        self.avatar_fps, self.loop_frames, self.start_frame = Fraction(avatar_fps), num_loop_frames, start_frame
        self.o, self.table = options, table
        self.encoder: PooledEncoder | None = None  # attach_encoder(): H.264 + audio in an encode process
        self._wake_engine, self._submit, self._clock = wake, submit, clock
        self.t0 = clock()
        self.stats = SessionStats()
        self.timings: deque[tuple[float, ...]] = deque(maxlen=TIMINGS_KEPT)  # seconds, by TIMING_STAGES
        self._lock = threading.Lock()
        self._utterances: deque[Utterance] = deque()
        self._next_uid = 0
        self._ring_base = 0
        self.next_frame = 0  # the next frame to plan
        self.play_frame = 0  # the next frame to hand out
        self.generation = 0  # bumped by clear(): renders planned before it are dropped
        self._ready: dict[int, LiveFrame] = {}
        # frames rendered (with their host buffer's release) or skipped (None), copied out and encoded
        # strictly in frame order from _out_next, so the encoders see every frame once, in order
        self._rendered: dict[int, tuple[Candidate, LiveFrame | None, Callable[[], None] | None]] = {}
        self._out_next = 0
        self._draining = False
        self._encoding: deque[tuple[Candidate, LiveFrame | None]] = deque()  # submitted, packets not back yet
        self._restart_at: int | None = None  # clear(): the encoders restart at this frame
        self._need_key = False  # encoded frames were thrown away: the next one is an IDR
        self._carry: list[EncodedPacket] = []  # packets of frames that came back after they played
        self._last = rest_frame
        self._last.flags.writeable = False
        self._out: deque = deque()  # items to yield before the next frame
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrived: asyncio.Event | None = None
        self.closed = False

    # --- the timeline --------------------------------------------------------------------------

    def deadline(self, frame: int) -> float:
        return self.t0 + self.o.playout_delay_s + float(frame / self.fps)

    def timings_ms(self) -> dict[str, list[float]]:
        """The kept speech frames' timings by stage (ms; "slack" < 0: ready after its deadline)."""
        with self._lock:
            rows = list(self.timings)
        return {name: [round(r[i] * 1000, 2) for r in rows] for i, name in enumerate(TIMING_STAGES)}

    def idle_due(self, frame: int, margin: float, cached: bool = False) -> float:
        """When an idle frame may be taken. A rendered one: up to one frame (or `margin`) before its media
        time, so the idle frames of sessions opened at different moments share steps; speech pushed
        after it starts a frame later, so the client waits up to two frames past the playout delay.
        A `cached` one (the avatar's idle loop is kept: no step) at its media time: speech starts at
        the next frame boundary, within one frame."""
        return self.t0 + float(frame / self.fps) - (0.0 if cached else min(margin, float(1 / self.fps)))

    def media_frame(self, now: float) -> int:
        """The first frame whose media time is not before `now` (where speech pushed now begins)."""
        return math.ceil((now - self.t0) * self.fps - 1e-9)

    # --- the caller's side ---------------------------------------------------------------------

    def push_audio(self, pcm: np.ndarray | torch.Tensor, rate: int) -> None:
        """Mono samples (float in [-1, 1], or int16) of the current utterance; opens one if none is open.

        Chunks of 10-1000 ms are what it is made for; any length works.
        """
        if not 8000 <= int(rate) <= 192_000:
            raise ValueError(f"rate: {rate} Hz; 8000 to 192000 are allowed")
        # numpy only: this runs on the caller's event loop, where each torch op would drop the GIL
        x = pcm.detach().cpu().numpy() if isinstance(pcm, torch.Tensor) else np.asarray(pcm)
        if x.ndim > 1 and 1 not in x.shape:
            raise ValueError(f"pcm: shape {tuple(np.shape(pcm))}; one channel (a 1-D array) is allowed")
        x = x.reshape(-1) / np.float32(32768.0) if x.dtype == np.int16 else x.astype(np.float32, copy=False).reshape(-1)
        if x.size == 0 or not np.isfinite(x).all():
            raise ValueError("pcm: empty, or holds NaN or infinite samples")
        now = self._clock()
        with self._lock:
            if self.closed:
                raise RuntimeError(f"session {self.id} is closed")
            u = self._utterances[-1] if self._utterances and not self._utterances[-1].ended else None
            if u is None or u.rate != int(rate):
                if u is not None:
                    u.end()
                u = self._open_utterance(now, int(rate))
            u.append(x, now)
        self._wake_engine()

    def end_utterance(self) -> None:
        """The utterance is complete: its last frames can be made without waiting for more audio."""
        ended_late = False
        with self._lock:
            if self._utterances and not self._utterances[-1].ended:
                u = self._utterances[-1]
                u.end()
                if u.frames_played and u.start_frame + u.frames(self.fps) <= self.play_frame:
                    # its end came after its last frame had played (the speech ran dry first): it
                    # finishes now, or no "finished" would ever be sent for it
                    self._out.append(SpeechEvent("finished", u.id, self.play_frame - 1,
                                                 float(Fraction(u.n48, AUDIO_RATE)), self._clock()))
                    self._retire(self.play_frame)
                    ended_late = True
        if ended_late:
            self._notify()
        self._wake_engine()

    def request_keyframe(self) -> None:
        """The next frame handed to the encoder is an IDR (a viewer lost packets; frames were dropped after us)."""
        with self._lock:
            self._need_key = True

    def clear(self) -> None:
        """Interrupt: drop all queued speech; the next frame handed out is idle again."""
        with self._lock:
            playing = self._playing_utterance(self.play_frame)
            if playing is not None:
                self._out.append(SpeechEvent("interrupted", playing.id, self.play_frame,
                                             float(Fraction(playing.frames_played) / self.fps), self._clock()))
            self._utterances.clear()
            self.generation += 1
            self._ready.clear()
            for _, _, release in self._rendered.values():
                if release is not None:
                    release()  # its host buffer goes back unread
            self._rendered.clear()
            # what was encoded ahead is thrown away: the encoders start again at the next frame to play
            self._out_next = self.play_frame
            self._restart_at = self.play_frame
            self._carry.clear()
            self.next_frame = min(self.next_frame, self.play_frame)
        self._notify()
        self._wake_engine()

    def _open_utterance(self, now: float, rate: int) -> Utterance:
        start = max(self.next_frame, self.media_frame(now))
        if self._utterances:
            last = self._utterances[-1]
            start = max(start, last.start_frame + last.frames(self.fps))
            self._ring_base = last.base + last.steps + 2 * WINDOW_STEPS
        u = Utterance(self._next_uid, start, self._ring_base, rate)
        self._next_uid += 1
        self._utterances.append(u)
        return u

    def _utterance_at(self, frame: int) -> Utterance | None:
        for u in self._utterances:
            n = u.frames(self.fps)
            if u.start_frame <= frame and (n is None or frame < u.start_frame + n):
                return u
        return None

    def _playing_utterance(self, frame: int) -> Utterance | None:
        u = self._utterance_at(frame)
        return u if u is not None and u.frames_played else None

    # --- the core's side -----------------------------------------------------------------------

    def window_jobs(self) -> list[WindowJob]:
        """Streaming feature windows that can be encoded now (and their bookkeeping, done at once:
        the core queues the encode before any step that reads the table)."""
        o = self.o
        jobs: list[WindowJob] = []
        c, h, r = o.context_steps, o.hop_steps, o.lookahead_steps
        w = c + h + r
        with self._lock:
            for u in self._utterances:
                while True:
                    f = u.final
                    if u.ended and f >= u.steps:
                        break
                    need = (f + h + r) * SAMPLES_PER_FEATURE + MARGIN
                    if not u.ended and u.n16 < need:
                        break
                    if u.base + f + h - self._lowest_needed() > self.table.ring - 2 * WINDOW_STEPS:
                        break  # the ring is full of steps not yet rendered
                    lo = (f - c) * SAMPLES_PER_FEATURE - MARGIN
                    audio = np.zeros(w * SAMPLES_PER_FEATURE + 2 * MARGIN, np.float32)
                    a, b = max(0, lo), min(u.n16, lo + audio.size)
                    if b > a:
                        audio[a - lo:b - lo] = u.audio16[a:b]
                    jobs.append(WindowJob(audio, f - c, self.slot, u.windows == 0,
                                          [self.table.row(self.slot, u.base + f + i) for i in range(h)]))
                    u.windows += 1
                    u.final = f + h
        return jobs

    def whole_utterances(self) -> list[tuple[np.ndarray, list[int]]]:
        """Ended utterances whose features come whole ("utterance" mode): (16 kHz audio, table rows)."""
        out = []
        with self._lock:
            for u in self._utterances:
                if u.ended and u.final == 0:
                    steps = u.steps
                    if steps > self.table.ring - 2 * WINDOW_STEPS:
                        raise ValueError(f"an utterance of {steps / FEATURE_RATE:.1f} s does not fit the "
                                         f"{self.table.ring / FEATURE_RATE:.1f} s feature ring (ring_steps)")
                    out.append((u.audio16[:u.n16].copy(), [self.table.row(self.slot, u.base + k) for k in range(steps)]))
                    u.final = steps
        return out

    def _lowest_needed(self) -> int:
        u = self._utterance_at(self.next_frame)
        if u is None:
            return 1 << 60
        return u.base + self._first_step(self.next_frame - u.start_frame)

    def _first_step(self, local: int) -> int:
        return (local * FEATURE_RATE * self.fps.denominator) // self.fps.numerator - LEFT_PAD_STEPS

    def candidates(self, now: float, limit: int, margin: float, idle_cached: bool = False) -> list[Candidate]:
        """Frames that can be rendered now, in order: speech frames whose window is known, idle
        frames once their media time has come (so speech pushed by then can still take them; see
        idle_due), and speech frames due within `margin` whose audio is late (rendered with silence
        for it)."""
        out: list[Candidate] = []
        kick = False
        with self._lock:
            if self.next_frame < self.play_frame:
                # the consumer played these (late) before the core reached them: given up, like
                # frames whose deadline passed; their audio still goes to the encoder, in order
                for g in range(max(self.next_frame, self._out_next), self.play_frame):
                    u = self._utterance_at(g)
                    self._rendered.setdefault(g, (Candidate(self, g, self.deadline(g), [], self._loop_frame(g),
                                                            None if u is None else u.id, self.generation, speech=u),
                                                  None, None))
                    self.stats.skipped += 1
                self.next_frame = self.play_frame
                kick = self._start_drain()
            f = self.next_frame
            while len(out) < limit:
                deadline = self.deadline(f)
                u = self._utterance_at(f)
                if u is None:
                    if now < self.idle_due(f, margin, idle_cached):
                        break
                    rows, underrun = self.table.idle, False
                else:
                    first = self._first_step(f - u.start_frame)
                    known = u.final if not (u.ended and u.final >= u.steps) else u.steps
                    limit_steps = u.steps if u.ended else None
                    ready = known >= first + WINDOW_STEPS or (limit_steps is not None and known >= limit_steps)
                    underrun = not ready
                    if underrun and deadline - now > margin:
                        break
                    rows = [self.table.row(self.slot, u.base + k) if 0 <= k < known else self.table.zero
                            for k in range(first, first + WINDOW_STEPS)]
                out.append(Candidate(self, f, deadline, rows, self._loop_frame(f), None if u is None else u.id,
                                     self.generation, underrun, now, u))
                f += 1
        if kick:
            self._submit(self._drain)
        return out

    def _loop_frame(self, frame: int) -> int:
        step = self.start_frame + math.floor(Fraction(frame) / self.fps * self.avatar_fps)
        return int(ping_pong(step, self.loop_frames))

    def take(self, taken: list[Candidate], skipped: list[Candidate]) -> None:
        """The core renders `taken` and gives up on `skipped` (their deadlines passed)."""
        with self._lock:
            for c in sorted(taken + skipped, key=lambda c: c.frame):
                if c.generation == self.generation and c.frame == self.next_frame:
                    self.next_frame += 1
            self.stats.skipped += len(skipped)
            self.stats.underruns += sum(c.underrun for c in taken)
            for c in skipped:  # their audio still goes to the encoder, in order
                if c.generation == self.generation and c.frame >= self._out_next:
                    self._rendered[c.frame] = (c, None, None)
            kick = self._start_drain()
        if kick:
            self._submit(self._drain)

    def _notify(self) -> None:
        loop, event = self._loop, self._arrived
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the consumer's loop has closed
                pass

    # --- the consumer's side -------------------------------------------------------------------

    def __aiter__(self) -> Session:
        return self

    async def __anext__(self) -> LiveFrame | SpeechEvent:
        if self._loop is None:
            self._loop, self._arrived = asyncio.get_running_loop(), asyncio.Event()
        while True:
            with self._lock:
                if self._out:
                    return self._out.popleft()
                if self.closed:
                    raise StopAsyncIteration
                f = self.play_frame
                have = f in self._ready
            now = self._clock()
            deadline = self.deadline(f)
            if now > deadline + FALL_BEHIND_S:
                self._skip_to(math.floor((now - self.t0 - self.o.playout_delay_s) * self.fps))
                continue
            if not have and now < deadline:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), deadline - now)
                except TimeoutError:
                    pass
                continue
            if now < deadline:
                await asyncio.sleep(deadline - now)
            self._play(f)

    def _skip_to(self, frame: int) -> None:
        with self._lock:
            if frame <= self.play_frame:
                return
            self.stats.dropped_unread += frame - self.play_frame
            self._drop_ready(frame)
            now = self._clock()
            for f in range(self.play_frame, frame):  # dropped unread: their speech events still go out
                u = self._utterance_at(f)
                if u is not None:
                    local = f - u.start_frame
                    if local == 0:
                        self._out.append(SpeechEvent("started", u.id, f, 0.0, now))
                    u.frames_played += 1
                    if u.ended and local == u.frames(self.fps) - 1:
                        self._out.append(SpeechEvent("finished", u.id, f, float(Fraction(u.n48, AUDIO_RATE)), now))
            self.play_frame = frame
            self._retire(frame)

    def _play(self, f: int) -> None:
        """Hand out frame f (or the previous picture if it is not ready), with its audio and events."""
        now = self._clock()
        end = None
        with self._lock:
            if f != self.play_frame:  # a clear() in between
                return
            frame = self._ready.pop(f, None)
            u = self._utterance_at(f)
            if frame is None or frame.utterance != (None if u is None else u.id):
                frame = LiveFrame(f, self.fps, self._last, np.zeros(0, np.float32), None if u is None else u.id,
                                  late=True)
                self.stats.late += 1
                self.stats.late_speech += u is not None
            local = f - u.start_frame if u is not None else f
            # a rendered frame brings the audio it was encoded with; a late one plays what is here now
            audio = self._audio48(u, local) if frame.late else frame.audio
            if u is not None and local == 0:
                self._out.append(SpeechEvent("started", u.id, f, 0.0, now))
            frame.audio, frame.played_at = audio, now
            if self._carry:
                frame.packets = self._carry + frame.packets
                self._carry = []
            self._last = frame.i420
            self.play_frame = f + 1
            self.stats.played += 1
            if u is not None:
                u.frames_played += 1
                if u.ended and local == u.frames(self.fps) - 1:
                    end = SpeechEvent("finished", u.id, f, float(Fraction(u.n48, AUDIO_RATE)), now)
                    self._retire(f + 1)
        self._out.append(frame)
        if end is not None:
            self._out.append(end)

    def _audio48(self, u: Utterance | None, local: int) -> np.ndarray:
        """The 48 kHz samples of frame `local` of utterance u (of the session, idle: silence)."""
        fps = self.fps
        a = (local * AUDIO_RATE * fps.denominator) // fps.numerator
        b = ((local + 1) * AUDIO_RATE * fps.denominator) // fps.numerator
        out = np.zeros(b - a, np.float32)
        if u is None:
            return out
        hi = min(b, u.n48)
        if hi > a:
            out[:hi - a] = u.audio48[a:hi]
        return out

    def _frame_audio(self, c: Candidate) -> np.ndarray:
        """The audio that plays (and is encoded) with frame c, as known now; what is missing is lost (counted)."""
        u = c.speech
        local = c.frame - u.start_frame if u is not None else c.frame
        if u is not None and not u.ended:
            b = ((local + 1) * AUDIO_RATE * self.fps.denominator) // self.fps.numerator
            if u.n48 < b:
                a = (local * AUDIO_RATE * self.fps.denominator) // self.fps.numerator
                self.stats.audio_late_samples += b - max(a, u.n48)
        return self._audio48(u, local)

    def _retire(self, frame: int) -> None:
        """Forget utterances that have played out entirely before `frame`."""
        while self._utterances:
            u = self._utterances[0]
            n = u.frames(self.fps)
            if n is None or u.start_frame + n > frame:
                break
            self._utterances.popleft()

    def close(self) -> None:
        """End the stream: the reader's iteration stops (LiveEngine.close_session also frees the slot)."""
        with self._lock:
            self.closed = True
            encoder, self.encoder = self.encoder, None
        self._notify()
        if encoder is not None:
            encoder.close()  # its last packets have no reader any more
