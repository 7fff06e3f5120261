"""A live session's playout: its frames handed out at their playout times, with their audio and speech events.

The consumer's event loop owns everything here: the ready frames, the pacing, the events, the
audio that goes out with each frame and the playout's counters. Frame f plays at its deadline
(`SessionClock`); a frame not ready by then is replaced by the previous picture and counted late;
a consumer that falls more than FALL_BEHIND_S behind skips ahead (frames dropped, counted).

What other threads hand over comes through one inbox (`arrive`): frames from the hand-off (copy
pool, encode reader), packets of frames given up, interrupts. The consumer drains it on its own
thread before each decision, so no state here is shared. The session's speech (which utterance a
frame plays, its audio) is read from the request (`SpeechRequest.speech_at`, `audio48`).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from fractions import Fraction

import numpy as np

from lipstream.aio import wait_for
from lipstream.live.items import LiveFrame, SessionClock, SpeechEvent
from lipstream.live.request import SpeechRequest
from lipstream.live.utterance import Utterance
from lipstream.media.rates import AUDIO_RATE

FALL_BEHIND_S = 1.0  # a consumer this far behind the playout clock skips ahead (frames dropped, counted)


def _no_keyframe() -> None:
    """A closed playout's request for a keyframe: nobody is listening."""


class Playout:
    """Made by LiveEngine.open_session, read with `async for item in session` (LiveFrame | SpeechEvent)."""

    def __init__(self, clock: SessionClock, request: SpeechRequest, rest_frame: np.ndarray,
                 want_keyframe: Callable[[], None], now: Callable[[], float]):
        self.clock, self.fps, self.request = clock, clock.fps, request
        self._want_keyframe, self._now = want_keyframe, now
        self.play_frame = 0  # the next frame to hand out (the core reads it: frames before it are past)
        self._ready: dict[int, LiveFrame] = {}
        self._last = rest_frame  # the picture a late frame repeats
        self._last.flags.writeable = False
        self._out: deque = deque()  # items to yield before the next frame
        self._carry: list = []  # packets of frames that came back after they played (and of given-up frames)
        self._speaking: Utterance | None = None  # the utterance being played: started, not finished
        self._spoken = 0  # its frames played so far
        self._generation = 0
        self._inbox: deque[tuple[str, int, object]] = deque()
        self._inbox_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrived: asyncio.Event | None = None
        self.closed = False
        # counters (SessionStats)
        self.rendered = self.played = self.late = self.late_speech = 0
        self.arrived_after_play = self.dropped_unread = 0

    # --- other threads' side: the inbox ----------------------------------------------------------

    def arrive(self, kind: str, generation: int, item: object) -> None:
        """From any thread: ("frame", LiveFrame), ("packets", [EncodedPacket]) or ("interrupt", None)."""
        with self._inbox_lock:
            if self.closed:
                return
            self._inbox.append((kind, generation, item))
            if kind == "frame" and len(self._inbox) > 1:
                self._trim_inbox()
        self.wake()

    def _trim_inbox(self) -> None:
        """A consumer that stopped reading: keep only the frames it could still play on time. What goes is
        the frames it can no longer play and the packets that came before them; packets followed by a
        frame it can still play are kept (the audio of given-up frames, which the consumer was merely
        slow to take: dropping it left a hole in the audio)."""
        oldest = self.clock.playing_frame(self._now() - FALL_BEHIND_S)
        cut = 0  # the inbox's first `cut` items go
        for i, (kind, _, item) in enumerate(self._inbox):
            if kind == "packets":
                continue
            if kind != "frame" or item.frame >= oldest:
                break
            cut = i + 1
        for _ in range(cut):
            kind, _, item = self._inbox.popleft()
            if kind == "packets" or item.packets:
                self._want_keyframe()  # the decoder loses a reference: start again from an IDR

    def interrupt(self, generation: int) -> None:
        """The speech was cleared: the next frame handed out is idle (generation: the request's new one)."""
        self.arrive("interrupt", generation, None)

    def wake(self) -> None:
        loop, event = self._loop, self._arrived
        if loop is not None and event is not None:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the consumer's loop has closed
                pass

    def close(self) -> None:
        """The frames it holds go at once: a closed session can outlive its close in a reference cycle
        (its reader's cancelled task, its peer's handlers) until the garbage collector's full pass, and
        the frames a session keeps ahead are 1.4 MB each at 1280x720."""
        with self._inbox_lock:
            self.closed = True
            self._inbox.clear()
        self._ready, self._carry = {}, []
        self._want_keyframe = _no_keyframe  # the hand-off's method: the cycle between the two is cut
        self.wake()

    def _take_inbox(self) -> None:
        with self._inbox_lock:
            items, self._inbox = self._inbox, deque()
        for kind, generation, item in items:
            if kind == "interrupt":
                self._interrupted(generation)
            elif generation != self._generation:
                continue  # planned before an interrupt
            elif kind == "packets":
                self._carry += item
            elif item.frame < self.play_frame:  # late, but the decoder needs it: it goes out with the next frame
                self.arrived_after_play += 1
                self._carry += item.packets
            else:
                self.rendered += 1
                self._ready[item.frame] = item

    def _interrupted(self, generation: int) -> None:
        self._generation = generation
        if self._speaking is not None:
            self._out.append(SpeechEvent("interrupted", self._speaking.id, self.play_frame,
                                         float(Fraction(self._spoken) / self.fps), self._now()))
            self._speaking = None
        self._ready.clear()
        self._carry = []  # the encoders restart with an IDR

    # --- the consumer's side ---------------------------------------------------------------------

    def __aiter__(self) -> Playout:
        return self

    async def __anext__(self) -> LiveFrame | SpeechEvent:
        if self._loop is None:
            self._loop, self._arrived = asyncio.get_running_loop(), asyncio.Event()
        while True:
            self._take_inbox()
            self._ended_late()
            if self._out:
                return self._out.popleft()
            if self.closed:
                self._ready = {}  # what a take of the inbox during the close put back
                raise StopAsyncIteration
            f = self.play_frame
            now = self._now()
            deadline = self.clock.deadline(f)
            if now > deadline + FALL_BEHIND_S:
                self._skip_to(self.clock.playing_frame(now))
                continue
            if f not in self._ready and now < deadline:
                self._arrived.clear()
                try:
                    await wait_for(self._arrived.wait(), deadline - now)
                except TimeoutError:
                    pass
                continue
            if now < deadline:
                await asyncio.sleep(deadline - now)
            self._play(f)

    def _ended_late(self) -> None:
        """An utterance whose end came after its last frame had played (its audio ran out first, and the
        frames after it played as its silence) finishes now: otherwise no "finished" would ever go out."""
        u = self._speaking
        if u is None:
            return
        end = self.request.end_frame(u)
        if end is not None and end <= self.play_frame:
            self._out.append(self._finished(u, self.play_frame - 1))

    def _finished(self, u: Utterance, frame: int) -> SpeechEvent:
        self._speaking = None
        return SpeechEvent("finished", u.id, frame, float(Fraction(u.n48, AUDIO_RATE)), self._now())

    def _spoke(self, u: Utterance | None, frame: int) -> SpeechEvent | None:
        """Frame `frame` of the timeline played (or was dropped): "started" goes out now, "finished" (its
        utterance's last frame) is returned, to go out after the frame."""
        if u is None:
            return None
        if frame == u.start_frame:
            self._out.append(SpeechEvent("started", u.id, frame, 0.0, self._now()))
        if self._speaking is not u:
            self._speaking, self._spoken = u, 0
        self._spoken += 1
        end = self.request.end_frame(u)
        return self._finished(u, frame) if end is not None and frame == end - 1 else None

    def _skip_to(self, frame: int) -> None:
        if frame <= self.play_frame:
            return
        self.dropped_unread += frame - self.play_frame
        self._drop_ready(frame)
        for f in range(self.play_frame, frame):  # dropped unread: their speech events still go out
            finished = self._spoke(self.request.speech_at(f), f)
            if finished is not None:
                self._out.append(finished)
        self.play_frame = frame

    def _drop_ready(self, below: int) -> None:
        for f in [f for f in self._ready if f < below]:
            if self._ready.pop(f).packets:
                self._want_keyframe()  # the decoder loses a reference: start again from an IDR
        if self._carry:
            self._carry = []
            self._want_keyframe()

    def _play(self, f: int) -> None:
        """Hand out frame f (or the previous picture if it is not ready), with its audio and events."""
        self._take_inbox()  # an interrupt that came while we waited: the frame is idle now
        frame = self._ready.pop(f, None)
        u = self.request.speech_at(f)
        if frame is None or frame.utterance != (None if u is None else u.id):
            frame = LiveFrame(f, self.fps, self._last, np.zeros(0, np.float32), None if u is None else u.id,
                              late=True)
            self.late += 1
            self.late_speech += u is not None
            # a rendered frame brings the audio it was encoded with; a late one plays what is here now
            frame.audio = self.request.audio48(u, f - u.start_frame if u is not None else f)
        frame.played_at = self._now()
        if self._carry:
            frame.packets = self._carry + frame.packets
            self._carry = []
        self._last = frame.i420
        self.play_frame = f + 1
        self.played += 1
        finished = self._spoke(u, f)
        self._out.append(frame)
        if finished is not None:
            self._out.append(finished)
