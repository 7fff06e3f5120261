"""The in-order handoff of a session's rendered frames: copied out, encoded, stored for playout.

The engine's core delivers frames in whatever order its steps finish them. The encoders must see
every frame once, in frame order (an H.264 stream's references; the audio with each frame), so
this part of a Session keeps them by frame number and drains them from `_out_next` on the copy
pool, one task per session at a time: copy out of the engine's host buffer (then release it),
submit to the session's encoder, and on its packets' return store the frame for the consumer.
A frame the core skipped sends its audio only; one that comes back after it played sends its
packets with the next frame played, so a decoder keeps its reference chain.

A mixin of Session (live/session.py): the state is the session's, under its lock.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from lipstream.live.features import MARGIN
from lipstream.live.items import Candidate, LiveFrame
from lipstream.rates import AUDIO_RATE
from lipstream.models.config import SAMPLE_RATE, SAMPLES_PER_FEATURE, WINDOW_STEPS

if TYPE_CHECKING:
    from lipstream.media.encode_pool import PooledEncoder
    from lipstream.media.session_encoder import EncodedPacket

log = logging.getLogger(__name__)
NO_AUDIO = np.zeros(0, np.float32)
NO_AUDIO.flags.writeable = False
FALL_BEHIND_S = 1.0  # a consumer this far behind the playout clock skips ahead (frames dropped, counted)
TIMING_STAGES = ("audio", "features", "render", "encode", "slack")  # Session.timings: where a speech frame's time went


class FrameHandoff:
    """Rendered frames -> copy-out -> encoder -> ready for playout, strictly in frame order."""

    def _start_drain(self) -> bool:
        """Under the lock: whether a drain must be started (the next frame in order is there, none runs)."""
        if self._draining or self._out_next not in self._rendered:
            return False
        self._draining = True
        return True

    def attach_encoder(self, encoder: PooledEncoder) -> None:
        self.encoder = encoder

    def deliver(self, c: Candidate, view: np.ndarray, now: float, release: Callable[[], None]) -> None:
        """A rendered frame, still in the engine's host buffer: on the copy pool it is copied out (then
        `release` frees the buffer) and handed to the encoder, one task per session at a time, in order."""
        frame = LiveFrame(c.frame, self.fps, view, NO_AUDIO, c.utterance)
        with self._lock:
            if c.generation != self.generation or self.closed or c.frame < self._out_next:
                release()
                return
            u = c.speech
            if u is not None:
                local = c.frame - u.start_frame
                frame.pushed_at = u.pushed_at((local * SAMPLE_RATE * self.fps.denominator) // self.fps.numerator)
                last = (self._first_step(local) + WINDOW_STEPS) * SAMPLES_PER_FEATURE + MARGIN
                frame.audio_at = u.pushed_at(min(last, u.n16 - 1))
            frame.planned_at, frame.rendered_at = c.planned_at, now
            old = self._rendered.get(c.frame)
            if old is not None and old[2] is not None:
                old[2]()
            self._rendered[c.frame] = (c, frame, release)
            if not self._start_drain():
                return
        self._submit(self._drain)

    def _drain(self) -> None:
        """Copy out and encode the frames in order (a skipped frame: its audio only)."""
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
                audio = self._frame_audio(c)
                key, self._need_key = self._need_key, False
                encoder = None if self.closed else self.encoder
                if encoder is not None:
                    self._encoding.append((c, frame))
            if frame is not None:
                try:
                    frame.i420 = frame.i420.copy()  # the session's own copy: the engine's buffer goes back
                finally:
                    release()
                frame.i420.flags.writeable = False
                frame.audio = audio
            if encoder is None:
                if frame is not None:
                    frame.ready_at = self._clock()
                    self._store(c, frame)
                continue
            try:
                if restart is not None:
                    encoder.restart(restart, (restart * AUDIO_RATE * self.fps.denominator) // self.fps.numerator)
                encoder.submit(c.frame, None if frame is None else frame.i420, audio, key)
            except Exception as e:  # noqa: BLE001 (the session goes on without packets)
                with self._lock:
                    try:
                        self._encoding.remove((c, frame))
                    except ValueError:  # a failing encoder already handed it on
                        pass
                self._encoder_failed(self.id, str(e))
                if frame is not None:
                    frame.ready_at = self._clock()
                    self._store(c, frame)

    def _encoded(self, pts: int, packets: list[EncodedPacket]) -> None:
        """The encoder's packets for frame `pts` (on the encode pool's reader thread, in frame order)."""
        with self._lock:
            if not self._encoding:
                return
            c, frame = self._encoding.popleft()
            if c.generation != self.generation:
                return
            if frame is None:  # a skipped frame's audio: it goes out with the next frame played
                self._carry += packets
                return
        frame.packets = packets
        frame.ready_at = self._clock()
        self._store(c, frame)

    def _encoder_failed(self, sid: int, why: str) -> None:
        """A frame could not be encoded, or the encode process is gone: frames go on without packets."""
        with self._lock:
            if self.encoder is None:
                return
            if self.encoder.failure is None:
                log.warning("session %d: %s (a frame goes out without packets)", self.id, why)
                return
            log.error("session %d: encoding stopped: %s; frames go on without packets", self.id, why)
            self.encoder = None
            waiting, self._encoding = list(self._encoding), deque()
        for c, frame in waiting:
            if frame is not None:
                frame.ready_at = self._clock()
                self._store(c, frame)

    def _store(self, c: Candidate, frame: LiveFrame) -> None:
        with self._lock:
            if c.generation != self.generation:
                return
            stages = frame.stages_s()
            if stages is not None:  # a speech frame: its stages, and what was left before its deadline
                self.timings.append((*stages, self.deadline(frame.pts) - frame.ready_at))
            if frame.pts < self.play_frame:
                self.stats.arrived_after_play += 1
                self._carry += frame.packets  # late, but the decoder needs it: it goes out with the next frame
                return
            self.stats.rendered += 1
            self._ready[frame.pts] = frame
            # a consumer that stopped reading: keep only what it could still play on time
            oldest = math.floor((self._clock() - self.t0 - self.o.playout_delay_s - FALL_BEHIND_S) * self.fps)
            if self.play_frame < oldest:
                self._drop_ready(oldest)
        self._notify()

    def _drop_ready(self, below: int) -> None:
        for f in [f for f in self._ready if f < below]:
            if self._ready.pop(f).packets:
                self._need_key = True  # the decoder loses a reference: start again from an IDR
        if self._carry:
            self._carry.clear()
            self._need_key = True
