"""The in-order hand-off of a session's rendered frames: copied out, encoded, passed to the playout.

The engine's core delivers frames in whatever order its steps finish them. The encoders must see
every frame once, in frame order (an H.264 stream's references; the audio with each frame), so
the hand-off keeps them by frame number and drains them from `_out_next` on the copy pool, one
task per session at a time: copy out of the engine's host buffer (then release it), submit to the
session's encoder, and on its packets' return pass the frame to the playout (`to_playout`). A frame
the core gave up sends its audio only, whose packets go to the playout alone.

Its state is its own, under its own lock: the copy pool's threads and the encode pool's reader
thread work here; the core calls `deliver` and `skip`, an interrupt calls `restart`.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from lipstream.audio.windows import LEFT_PAD_STEPS
from lipstream.live.features import MARGIN
from lipstream.live.items import LiveFrame, SessionClock
from lipstream.live.request import Candidate
from lipstream.models.config import SAMPLE_RATE, SAMPLES_PER_FEATURE, WINDOW_STEPS

if TYPE_CHECKING:
    from lipstream.media.encode_pool import PooledEncoder
    from lipstream.media.session_encoder import EncodedPacket

log = logging.getLogger(__name__)
NO_AUDIO = np.zeros(0, np.float32)
NO_AUDIO.flags.writeable = False
TIMINGS_KEPT = 6000  # speech frames' timings a session keeps (4 minutes at 25 fps)

Release = Callable[[], None]
# what reaches the playout: ("frame", generation, LiveFrame) or ("packets", generation, [EncodedPacket])
ToPlayout = Callable[[str, int, object], None]


class FrameHandoff:
    """Rendered frames -> copy-out -> encoder -> the playout, strictly in frame order."""

    def __init__(self, sid: int, clock: SessionClock, first_step: Callable[[int], int],
                 frame_audio: Callable[[Candidate], tuple[np.ndarray, int]], to_playout: ToPlayout,
                 submit: Callable[[Callable[[], None]], object], now: Callable[[], float],
                 window_ahead_steps: int = WINDOW_STEPS - LEFT_PAD_STEPS):
        self.id, self.clock = sid, clock
        self._window_ahead = window_ahead_steps  # how far past its start a frame's window is waited for
        self._first_step, self._frame_audio, self._to_playout = first_step, frame_audio, to_playout
        self._submit, self._now = submit, now
        self._lock = threading.Lock()
        self.encoder: PooledEncoder | None = None  # attach_encoder(): H.264 + audio in an encode process
        self.encoder_lost: str | None = None  # why the encoder stopped for good (its process died): no packets
        self.generation = 0  # frames of an older generation (planned before an interrupt) are dropped
        # frames rendered (with their host buffer's release) or given up (None), copied out and encoded
        # strictly in frame order from _out_next, so the encoders see every frame once, in order
        self._rendered: dict[int, tuple[Candidate, LiveFrame | None, Release | None]] = {}
        self._out_next = 0
        self._draining = False
        self._encoding: deque[tuple[Candidate, LiveFrame | None]] = deque()  # submitted, packets not back yet
        self._restart_at: int | None = None  # an interrupt: the encoders restart at this frame
        self._need_key = False  # encoded frames were thrown away: the next one is an IDR
        self._cuts: deque[tuple[int, int]] = deque(maxlen=16)  # camera cuts: (number, first frame), the latest last
        self.closed = False
        self.audio_late_samples = 0  # pushed after their frame had gone to the encoder (never heard)
        self.timings: deque[tuple[float, ...]] = deque(maxlen=TIMINGS_KEPT)  # seconds, by items.TIMING_STAGES

    def attach_encoder(self, encoder: PooledEncoder) -> None:
        self.encoder = encoder

    # --- the core's side -------------------------------------------------------------------------

    def deliver(self, c: Candidate, view: np.ndarray, now: float, release: Release) -> None:
        """A rendered frame, still in the engine's host buffer: on the copy pool it is copied out (then
        `release` frees the buffer) and handed to the encoder, one task per session at a time, in order."""
        frame = LiveFrame(c.frame, self.clock.fps, view, NO_AUDIO, c.utterance)
        u = c.speech
        if u is not None:  # its audio's push times: the utterance is the frame's own, even after it left the request
            local = c.frame - u.start_frame
            fps = self.clock.fps
            frame.pushed_at = u.pushed_at((local * SAMPLE_RATE * fps.denominator) // fps.numerator)
            last = (self._first_step(local) + LEFT_PAD_STEPS + self._window_ahead) * SAMPLES_PER_FEATURE + MARGIN
            frame.audio_at = u.pushed_at(min(last, u.n16 - 1))
        frame.planned_at, frame.rendered_at = c.planned_at, now
        with self._lock:
            if c.generation != self.generation or self.closed or c.frame < self._out_next or self._superseded(c):
                release()
                return
            old = self._rendered.get(c.frame)
            if old is not None and old[2] is not None:
                old[2]()
            self._rendered[c.frame] = (c, frame, release)
            kick = self._start_drain()
        if kick:
            self._submit(self._drain)

    def skip(self, given_up: list[Candidate]) -> None:
        """Frames the core gave up (never rendered): their audio still goes to the encoder, in order."""
        with self._lock:
            for c in given_up:
                if c.generation == self.generation and c.frame >= self._out_next:
                    self._rendered.setdefault(c.frame, (c, None, None))
            kick = self._start_drain()
        if kick:
            self._submit(self._drain)

    def _start_drain(self) -> bool:
        """Under the lock: whether a drain must be started (the next frame in order is there, none runs)."""
        if self._draining or self._out_next not in self._rendered:
            return False
        self._draining = True
        return True

    # --- an interrupt; a viewer ------------------------------------------------------------------

    def restart(self, at_frame: int, generation: int) -> None:
        """What was rendered or encoded ahead is thrown away: the encoders start again at `at_frame`."""
        with self._lock:
            self.generation = generation
            self._drop_rendered()
            self._out_next = at_frame
            self._restart_at = at_frame

    def rewind(self, at_frame: int, number: int) -> None:
        """Camera cut `number`: frames from `at_frame` on planned before it are rendered again (those
        before it stay, and so do the frames planned after it). Encoded ones are encoded again (the
        encoders start again at `at_frame`, with an IDR); the playout takes each new frame in the place
        of the one it had. Called under the request's lock, before any frame is planned with the cut."""
        with self._lock:
            self._cuts.append((number, at_frame))
            for f in [f for f, (c, _, _) in self._rendered.items() if self._superseded(c)]:
                release = self._rendered.pop(f)[2]
                if release is not None:
                    release()
            if self._out_next > at_frame:
                self._out_next = at_frame
                self._restart_at = at_frame

    def _superseded(self, c: Candidate) -> bool:
        """Under the lock: planned before a cut that lands at or before its frame (the wrong avatar's picture)."""
        return any(number > c.cut and at <= c.frame for number, at in self._cuts)

    def _drop_rendered(self) -> None:
        """Under the lock: the frames waiting for the copy-out go, their host buffers back to the engine unread."""
        for _, _, release in self._rendered.values():
            if release is not None:
                release()
        self._rendered.clear()

    def want_keyframe(self) -> None:
        """The next frame handed to the encoder is an IDR (a viewer lost packets; frames were dropped after us)."""
        with self._lock:
            self._need_key = True

    # --- the copy pool's side --------------------------------------------------------------------

    def _drain(self) -> None:
        """Copy out and encode the frames in order (a given-up frame: its audio only)."""
        while True:
            with self._lock:
                restart, self._restart_at = self._restart_at, None
                entry = self._rendered.pop(self._out_next, None)
                if entry is None:
                    self._draining = False
                    if restart is not None:
                        self._restart_at = restart
                    return
                self._out_next += 1
                c, frame, release = entry
                key, self._need_key = self._need_key, False
                encoder = None if self.closed else self.encoder
                if encoder is not None:
                    self._encoding.append((c, frame))
            audio, missing = self._frame_audio(c)  # as pushed by now: what is missing is lost (counted)
            if missing:
                with self._lock:
                    self.audio_late_samples += missing
            if frame is not None:
                try:
                    frame.i420 = frame.i420.copy()  # the session's own copy: the engine's buffer goes back
                finally:
                    release()
                frame.i420.flags.writeable = False
                frame.audio = audio
            if encoder is None:
                if frame is not None:
                    self._ready(c, frame)
                continue
            try:
                if restart is not None:
                    encoder.restart(restart, self.clock.samples48(restart)[0])
                encoder.submit(c.frame, None if frame is None else frame.i420, audio, key)
            except Exception as e:  # noqa: BLE001 (the session goes on without packets)
                with self._lock:
                    try:
                        self._encoding.remove((c, frame))
                    except ValueError:  # a failing encoder already handed it on
                        pass
                self.encoder_failed(self.id, str(e))
                if frame is not None:
                    self._ready(c, frame)

    # --- the encode pool's reader thread ---------------------------------------------------------

    def encoded(self, pts: int, packets: list[EncodedPacket]) -> None:
        """The encoder's packets for frame `pts` (its video time base is 1 / fps), in frame order."""
        with self._lock:
            if not self._encoding:
                return
            c, frame = self._encoding.popleft()
            if c.generation != self.generation:
                return
        if frame is None:  # a given-up frame's audio: it goes out with the next frame played
            self._to_playout("packets", c.generation, packets)
            return
        frame.packets = packets
        self._ready(c, frame)

    def encoder_failed(self, sid: int, why: str) -> None:
        """A frame could not be encoded, or the encode process is gone: frames go on without packets."""
        with self._lock:
            if self.encoder is None:
                return
            if self.encoder.failure is None:
                log.warning("session %d: %s (a frame goes out without packets)", self.id, why)
                return
            log.error("session %d: encoding stopped: %s; frames go on without packets", self.id, why)
            self.encoder, self.encoder_lost = None, why
            waiting, self._encoding = list(self._encoding), deque()
        for c, frame in waiting:
            if frame is not None:
                self._ready(c, frame)

    def _ready(self, c: Candidate, frame: LiveFrame) -> None:
        """The frame is ready (encoded): its timings kept, the frame to the playout."""
        frame.ready_at = self._now()
        stages = frame.stages_s()
        if stages is not None:  # a speech frame: its stages, and what was left before its deadline
            with self._lock:
                self.timings.append((*stages, self.clock.deadline(frame.frame) - frame.ready_at))
        self._to_playout("frame", c.generation, frame)

    def kept_timings(self) -> list[tuple[float, ...]]:
        with self._lock:
            return list(self.timings)

    def close(self) -> None:
        """The frames waiting here go (their host buffers back to the engine) and the encoder closes."""
        with self._lock:
            self.closed = True
            encoder, self.encoder = self.encoder, None
            self._drop_rendered()
            self._encoding.clear()
        if encoder is not None:
            encoder.close()  # its last packets have no reader any more
