"""What a live session hands out (frames, speech events, counters) and the clock its parts share."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

from lipstream.media.rates import AUDIO_RATE

if TYPE_CHECKING:
    from lipstream.media.session_encoder import EncodedPacket


def _pts_deprecated(owner: str) -> None:
    warnings.warn(f"{owner}.pts is deprecated: it is the frame index, now {owner}.frame (pts is kept for one "
                  "release)", DeprecationWarning, stacklevel=3)


@dataclass
class LiveFrame:
    """A frame at its playout time. `i420` [H*3/2, W] uint8 and `audio` (48 kHz mono float32) are the
    session's own copies (read-only), never views into engine buffers."""

    frame: int  # the frame's index in the session: it plays at frame / fps on the session's clock
    fps: Fraction
    i420: np.ndarray
    audio: np.ndarray
    utterance: int | None  # the utterance it speaks, None when idle
    late: bool = False  # not ready at its deadline: the previous picture again
    packets: list[EncodedPacket] = field(default_factory=list)  # its H.264 packet, then its audio packets
    pushed_at: float | None = None  # time.monotonic() when the audio at this frame's start was pushed
    ready_at: float | None = None  # time.monotonic() when it was rendered (and encoded)
    # where its latency went (time.monotonic()): the last audio its window needs was pushed, the
    # core planned it, its pixels were on the host
    audio_at: float | None = None
    planned_at: float | None = None
    rendered_at: float | None = None
    played_at: float = 0.0

    @property
    def pts(self) -> int:
        _pts_deprecated("LiveFrame")
        return self.frame

    @property
    def time_s(self) -> float:
        return float(self.frame / self.fps)

    def stages_s(self) -> tuple[float, float, float, float] | None:
        """Where a speech frame's latency went (s): its window's audio arriving, waiting for the core
        (features, scheduling), the step with the copy to host, copy-out and encode; None when idle."""
        if self.pushed_at is None or self.audio_at is None or self.ready_at is None:
            return None
        return (self.audio_at - self.pushed_at, self.planned_at - self.audio_at,
                self.rendered_at - self.planned_at, self.ready_at - self.rendered_at)

    @property
    def latency_s(self) -> float | None:
        """From the push of the audio it shows to the frame being ready (encoded)."""
        return None if self.pushed_at is None or self.ready_at is None else self.ready_at - self.pushed_at


@dataclass(frozen=True)
class SpeechEvent:
    kind: str  # "started", "finished" or "interrupted": at playout, not at push
    utterance: int
    frame: int  # the frame it happens at
    position_s: float  # how much of the utterance had played
    at: float  # time.monotonic()

    @property
    def pts(self) -> int:
        _pts_deprecated("SpeechEvent")
        return self.frame


@dataclass
class SessionStats:
    """A session's counters, each kept by the part of the session that counts it (Session.stats)."""

    rendered: int = 0
    played: int = 0
    late: int = 0  # played as the previous picture: not ready at the deadline
    late_speech: int = 0  # of those, frames of an utterance
    arrived_after_play: int = 0  # rendered, but after their deadline had passed
    skipped: int = 0  # deadline passed before the core reached it (not rendered)
    underruns: int = 0  # rendered before its audio had all arrived
    dropped_unread: int = 0  # never read: the consumer fell behind
    audio_late_samples: int = 0  # pushed after its frames had played (lost)


TIMING_STAGES = ("audio", "features", "render", "encode", "slack")  # Session.timings: where a speech frame's time went


@dataclass(frozen=True)
class SessionClock:
    """A session's timeline, the same for all its parts: frame f plays at `t0 + delay + f / fps`."""

    t0: float  # time.monotonic() at the session's start
    delay_s: float  # the playout delay: speech pushed at t plays at t + delay
    fps: Fraction

    def deadline(self, frame: int) -> float:
        return self.t0 + self.delay_s + float(frame / self.fps)

    def media_frame(self, now: float) -> int:
        """The first frame whose media time is not before `now` (where speech pushed now begins)."""
        return math.ceil((now - self.t0) * self.fps - 1e-9)

    def playing_frame(self, now: float) -> int:
        """The frame whose playout time `now` is in."""
        return math.floor((now - self.t0 - self.delay_s) * self.fps)

    def samples48(self, local: int) -> tuple[int, int]:
        """The 48 kHz samples [a, b) of frame `local` of an utterance (or of the session)."""
        fps = self.fps
        return ((local * AUDIO_RATE * fps.denominator) // fps.numerator,
                ((local + 1) * AUDIO_RATE * fps.denominator) // fps.numerator)
