"""What flows through a live session: frames and events out, render candidates to the core, counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from lipstream.media.session_encoder import EncodedPacket
    from lipstream.live.session import Session
    from lipstream.live.utterance import Utterance


@dataclass
class LiveFrame:
    """A frame at its playout time. `i420` [H*3/2, W] uint8 and `audio` (48 kHz mono float32) are the
    session's own copies (read-only), never views into engine buffers."""

    pts: int  # frame index in the session: time pts / fps
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
    def time_s(self) -> float:
        return float(self.pts / self.fps)

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
    pts: int  # the frame it happens at
    position_s: float  # how much of the utterance had played
    at: float  # time.monotonic()


@dataclass
class Candidate:
    """A frame the core may render now: where its audio window and its picture come from."""

    session: Session
    frame: int
    deadline: float
    rows: list[int]  # 10 feature-table rows
    loop_frame: int
    utterance: int | None
    generation: int
    underrun: bool = False  # rendered before all of its audio arrived (the missing part reads silence)
    planned_at: float = 0.0
    # the utterance itself (None when idle): a frame that comes back after its utterance has played out
    # and left the session's timeline still has its audio and its push times (late frames' account)
    speech: Utterance | None = None


@dataclass
class SessionStats:
    rendered: int = 0
    played: int = 0
    late: int = 0  # played as the previous picture: not ready at the deadline
    late_speech: int = 0  # of those, frames of an utterance
    arrived_after_play: int = 0  # rendered, but after their deadline had passed
    skipped: int = 0  # deadline passed before the core reached it (not rendered)
    underruns: int = 0  # rendered before its audio had all arrived
    dropped_unread: int = 0  # never read: the consumer fell behind
    audio_late_samples: int = 0  # pushed after its frames had played (lost)
