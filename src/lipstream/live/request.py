"""A live session's request state, the part the engine's core reads and writes (vLLM's Request).

The speech pushed so far (utterances: their audio at 16 and 48 kHz, where they start on the
session's timeline), how far each utterance's features are, the next frame to plan, and the
generation (bumped by an interrupt: frames planned before it are dropped). The caller's pushes,
ends and interrupts and the core's turns change it, always under its lock and only through the
methods below. The core asks it which frames can be rendered now (`candidates`) and tells it which
it took (`take`); the playout side only reads it (`speech_at`, `audio48`).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Container
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from lipstream.audio.windows import LEFT_PAD_STEPS
from lipstream.avatar import ping_pong
from lipstream.live.features import MARGIN, FeatureTable, WindowJob
from lipstream.live.items import SessionClock
from lipstream.live.options import LiveOptions
from lipstream.live.utterance import Utterance
from lipstream.models.config import FEATURE_RATE, SAMPLES_PER_FEATURE, WINDOW_STEPS


@dataclass(frozen=True)
class Cut:
    """From `frame` on, the session's pictures come from this resident avatar (a camera cut). Its loop
    goes on where the session's loop position is: cameras filmed together stay in step."""

    frame: int
    number: int  # the session's cuts are numbered from 0 (the avatar it opened on)
    avatar: int  # the engine's index
    avatar_fps: Fraction
    loop_frames: int


@dataclass
class Candidate:
    """A frame the core may render now: where its audio window and its picture come from."""

    session: int  # the session's id
    frame: int
    deadline: float
    rows: list[int]  # 10 feature-table rows
    avatar: int  # the engine's index of the session's avatar
    loop_frame: int
    utterance: int | None
    generation: int
    underrun: bool = False  # rendered before all of its audio arrived (the missing part reads silence)
    planned_at: float = 0.0
    # the utterance itself (None when idle): a frame that comes back after its utterance has played out
    # and left the request still has its audio and its push times (late frames' account)
    speech: Utterance | None = None
    cut: int = 0  # the number of the session's latest cut when it was planned (a later cut may supersede it)


class SpeechRequest:
    """The core's view of one session: its speech, its features' progress, the next frame to plan."""

    def __init__(self, sid: int, ring: int, avatar: int, avatar_fps: Fraction, loop_frames: int, start_frame: int,
                 clock: SessionClock, options: LiveOptions, table: FeatureTable):
        self.id, self.ring, self.start_frame = sid, ring, start_frame
        self._cuts = [Cut(0, 0, avatar, Fraction(avatar_fps), loop_frames)]  # by frame; the first from frame 0
        self.clock, self.o, self.table = clock, options, table
        self.fps = clock.fps
        self._lock = threading.Lock()
        self._utterances: deque[Utterance] = deque()
        self._next_uid = 0
        self._ring_base = 0  # where the next utterance's features go in the session's ring of table rows
        self.next_frame = 0  # the next frame to plan
        self.generation = 0  # bumped by clear(): renders planned before it are dropped
        self.skipped = 0  # frames given up (their deadline passed, or they played before the core came)
        self.underruns = 0

    # --- the caller's side: speech in --------------------------------------------------------------

    def push(self, pcm: np.ndarray, rate: int, now: float) -> None:
        """Mono float32 samples of the current utterance (a new one if none is open or the rate changed)."""
        with self._lock:
            u = self._utterances[-1] if self._utterances and not self._utterances[-1].ended else None
            if u is None or u.rate != rate:
                if u is not None:
                    u.end()
                u = self._open(now, rate)
            u.append(pcm, now)

    def end(self) -> Utterance | None:
        """End the open utterance (its last frames need no more audio); the one ended, if any."""
        with self._lock:
            if self._utterances and not self._utterances[-1].ended:
                u = self._utterances[-1]
                u.end()
                return u
        return None

    def clear(self, at_frame: int) -> int:
        """Drop all queued speech: frames from `at_frame` on are planned again, idle; the new generation."""
        with self._lock:
            self._utterances.clear()
            self.generation += 1
            self.next_frame = min(self.next_frame, at_frame)
            return self.generation

    def cut(self, avatar: int, avatar_fps: Fraction, loop_frames: int, now: float,
            rewind: Callable[[int, int], None]) -> int:
        """From the frame where speech pushed now begins (so a cut and a push at one moment land
        together), pictures come from `avatar`; the frame it lands on. Speech frames from there on
        rendered ahead with the avatar before are planned again (superseded); the speech goes on.
        They play at least the playout delay from now, so there is time to render them again; unless
        an utterance pushed far ahead has already reused their feature rows: then the cut lands on
        the next frame not yet planned. `rewind(frame, number)` tells the hand-off, under this lock:
        no frame is planned with the new cut before it knows."""
        with self._lock:
            at = max(self.clock.media_frame(now), self._cuts[-1].frame)
            if at < self.next_frame and (not self._speaks_between(at, self.next_frame) or not self._rows_kept(at)):
                at = self.next_frame  # idle frames taken a frame early: where speech pushed now begins too
            number = self._cuts[-1].number + 1
            while len(self._cuts) > 1 and self._cuts[-1].frame >= at:
                self._cuts.pop()  # a cut made before that lands at or after this one's frame: replaced
            self._cuts.append(Cut(at, number, avatar, Fraction(avatar_fps), loop_frames))
            self.next_frame = min(self.next_frame, at)
            rewind(at, number)
            return at

    def _superseded(self, c: Candidate) -> bool:
        """A frame planned before a cut that lands at or before it: its picture is the wrong avatar's."""
        return any(cut.number > c.cut and cut.frame <= c.frame for cut in self._cuts)

    def _speaks_between(self, a: int, b: int) -> bool:
        """Whether an utterance plays in frames [a, b)."""
        for u in self._utterances:
            n = u.frames(self.fps)
            if u.start_frame < b and (n is None or u.start_frame + n > a):
                return True
        return False

    def _rows_kept(self, frame: int) -> bool:
        """Whether frame's feature rows are still in the ring (none newer has been written over them)."""
        u = self._utterance_at(frame)
        if u is None:
            return True
        newest = max(v.base + v.final for v in self._utterances)
        return u.base + self.first_step(frame - u.start_frame) > newest - (self.table.ring_steps - 2 * WINDOW_STEPS)

    @property
    def avatar(self) -> int:
        """The avatar of the latest cut (the one new frames come from once it is reached)."""
        return self._cuts[-1].avatar

    def _cut_at(self, frame: int) -> Cut:
        for c in reversed(self._cuts):
            if c.frame <= frame:
                return c
        return self._cuts[0]

    def _open(self, now: float, rate: int) -> Utterance:
        start = max(self.next_frame, self.clock.media_frame(now))
        if self._utterances:
            last = self._utterances[-1]
            start = max(start, last.start_frame + last.frames(self.fps))
            self._ring_base = last.base + last.steps + 2 * WINDOW_STEPS
        u = Utterance(self._next_uid, start, self._ring_base, rate)
        self._next_uid += 1
        self._utterances.append(u)
        return u

    # --- the playout side's reads ------------------------------------------------------------------

    def speech_at(self, frame: int) -> Utterance | None:
        """The utterance that frame plays, if any (None once it has played out and left)."""
        with self._lock:
            return self._utterance_at(frame)

    def audio48(self, u: Utterance | None, local: int) -> np.ndarray:
        """The 48 kHz samples of frame `local` of utterance u as pushed so far (idle: silence)."""
        a, b = self.clock.samples48(local)
        if u is None:
            return np.zeros(b - a, np.float32)
        with self._lock:
            return u.samples48(a, b)

    def _utterance_at(self, frame: int) -> Utterance | None:
        for u in self._utterances:
            n = u.frames(self.fps)
            if u.start_frame <= frame and (n is None or frame < u.start_frame + n):
                return u
        return None

    # --- the core's side ---------------------------------------------------------------------------

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
                    if u.base + f + h - self._lowest_needed() > self.table.ring_steps - 2 * WINDOW_STEPS:
                        break  # the ring is full of steps not yet rendered
                    lo = (f - c) * SAMPLES_PER_FEATURE - MARGIN
                    audio = np.zeros(w * SAMPLES_PER_FEATURE + 2 * MARGIN, np.float32)
                    a, b = max(0, lo), min(u.n16, lo + audio.size)
                    if b > a:
                        audio[a - lo:b - lo] = u.audio16[a:b]
                    jobs.append(WindowJob(audio, f - c, self.ring, u.windows == 0,
                                          [self.table.row(self.ring, u.base + f + i) for i in range(h)]))
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
                    if steps > self.table.ring_steps - 2 * WINDOW_STEPS:
                        raise ValueError(f"an utterance of {steps / FEATURE_RATE:.1f} s does not fit the "
                                         f"{self.table.ring_steps / FEATURE_RATE:.1f} s feature ring (ring_steps)")
                    out.append((u.audio16[:u.n16].copy(), [self.table.row(self.ring, u.base + k) for k in range(steps)]))
                    u.final = steps
        return out

    def _lowest_needed(self) -> int:
        u = self._utterance_at(self.next_frame)
        if u is None:
            return 1 << 60
        return u.base + self.first_step(self.next_frame - u.start_frame)

    def first_step(self, local: int) -> int:
        """The first feature step of frame `local`'s window (its utterance's steps; negative: left padding)."""
        return (local * FEATURE_RATE * self.fps.denominator) // self.fps.numerator - LEFT_PAD_STEPS

    def idle_due(self, frame: int, margin: float, idle_cached: Container[int] = ()) -> float:
        """When an idle frame may be taken. A rendered one: up to one frame (or `margin`) before its media
        time, so the idle frames of sessions opened at different moments share steps; speech pushed
        after it starts a frame later, so the client waits up to two frames past the playout delay.
        A kept one (its avatar's idle loop is in `idle_cached`: no step) at its media time: speech starts
        at the next frame boundary, within one frame."""
        cached = self._cut_at(frame).avatar in idle_cached
        return self.clock.t0 + float(frame / self.fps) - (0.0 if cached else min(margin, float(1 / self.fps)))

    def candidates(self, now: float, limit: int, margin: float, played: int,
                   idle_cached: Container[int] = ()) -> tuple[list[Candidate], list[Candidate]]:
        """Frames that can be rendered now, in order: speech frames whose window is known, idle frames
        once their media time has come (so speech pushed by then can still take them; see idle_due), and
        speech frames due within `margin` whose audio is late (rendered with silence for it). And, first,
        the frames below `played` (the playout's next frame) the core never reached: given up, for the
        handoff to send their audio on in order. Idle frames of the avatars in `idle_cached` are kept
        pictures (no step)."""
        out: list[Candidate] = []
        given_up: list[Candidate] = []
        with self._lock:
            self._retire(played)
            while len(self._cuts) > 1 and self._cuts[1].frame <= min(self.next_frame, played):
                self._cuts.pop(0)  # no frame before it is planned again
            if self.next_frame < played:  # the consumer played these (late) before the core reached them
                for g in range(self.next_frame, played):
                    u = self._utterance_at(g)
                    given_up.append(self._candidate(g, [], u, False, now))
                self.skipped += played - self.next_frame
                self.next_frame = played
            f = self.next_frame
            while len(out) < limit:
                u = self._utterance_at(f)
                if u is None:
                    if now < self.idle_due(f, margin, idle_cached):
                        break
                    rows, underrun = self.table.idle, False
                else:
                    first = self.first_step(f - u.start_frame)
                    known = u.final if not (u.ended and u.final >= u.steps) else u.steps
                    limit_steps = u.steps if u.ended else None
                    whole = known >= first + WINDOW_STEPS or (limit_steps is not None and known >= limit_steps)
                    # window_ahead_steps < 6: rendered once the window is in up to that far past the frame's
                    # start, the steps not in yet repeating the last that is (the mouth goes on as it was)
                    soon = not whole and known >= first + LEFT_PAD_STEPS + self.o.window_ahead_steps
                    underrun = not (whole or soon)
                    if underrun and self.clock.deadline(f) - now > margin:
                        break
                    rows = [self._row(u, k, known, soon, limit_steps) for k in range(first, first + WINDOW_STEPS)]
                out.append(self._candidate(f, rows, u, underrun, now))
                f += 1
        return out, given_up

    def _row(self, u: Utterance, k: int, known: int, soon: bool, limit: int | None) -> int:
        """The table row of step k of u's features as a frame planned now reads it: its own once final; past
        the end of an ended utterance, or before its start, zeros (as offline); not in yet, zeros (audio
        late), or for a frame rendered `soon` the last step that is in."""
        if 0 <= k < known:
            return self.table.row(self.ring, u.base + k)
        if soon and known > 0 and k >= known and (limit is None or k < limit):
            return self.table.row(self.ring, u.base + known - 1)
        return self.table.zero

    def _candidate(self, frame: int, rows: list[int], u: Utterance | None, underrun: bool, now: float) -> Candidate:
        cut = self._cut_at(frame)
        step = self.start_frame + math.floor(Fraction(frame) / self.fps * cut.avatar_fps)
        loop_frame = int(ping_pong(step, cut.loop_frames))
        return Candidate(self.id, frame, self.clock.deadline(frame), rows, cut.avatar, loop_frame,
                         None if u is None else u.id, self.generation, underrun, now, u, self._cuts[-1].number)

    def take(self, taken: list[Candidate], skipped: list[Candidate]) -> None:
        """The core renders `taken` and gives up on `skipped` (their deadlines passed)."""
        with self._lock:
            for c in sorted(taken + skipped, key=lambda c: c.frame):
                if c.generation == self.generation and c.frame == self.next_frame and not self._superseded(c):
                    self.next_frame += 1
            self.skipped += len(skipped)
            self.underruns += sum(c.underrun for c in taken)

    def _retire(self, frame: int) -> None:
        """Forget utterances that have played out entirely before `frame` (their frames keep them)."""
        while self._utterances:
            u = self._utterances[0]
            n = u.frames(self.fps)
            if n is None or u.start_frame + n > frame:
                break
            self._utterances.popleft()

    def end_frame(self, u: Utterance) -> int | None:
        """The frame after u's last (None while it is open)."""
        with self._lock:
            return u.start_frame + u.frames(self.fps) if u.ended else None

    def frame_audio(self, c: Candidate) -> tuple[np.ndarray, int]:
        """The audio that plays (and is encoded) with frame c as pushed so far, and how many of its samples
        are not in yet: they never will be heard (the frame goes out now)."""
        u = c.speech
        a, b = self.clock.samples48(c.frame - u.start_frame if u is not None else c.frame)
        if u is None:
            return np.zeros(b - a, np.float32), 0
        with self._lock:
            missing = 0 if u.ended else max(0, b - max(a, u.n48))
            return u.samples48(a, b), missing
