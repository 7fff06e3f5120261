"""One utterance of a live session: its audio at 16 and 48 kHz, its place on the timeline, its features' progress."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from lipstream.audio.resample import StreamResampler
from lipstream.audio.windows import num_frames
from lipstream.media.rates import AUDIO_RATE
from lipstream.models.config import SAMPLE_RATE, SAMPLES_PER_FEATURE


class Utterance:
    """One stretch of speech: its audio, where it sits on the timeline, how far its features are.

    Part of a session's SpeechRequest and changed only under its lock: the audio and `ended` by the caller's
    pushes, `final` and `windows` (the features' progress) by the core. Its frames keep a reference, so an
    utterance that has played out and left the request still gives them their audio and push times.
    """

    def __init__(self, uid: int, start_frame: int, base: int, rate: int):
        self.id, self.start_frame, self.base = uid, start_frame, base
        self.to16, self.to48 = StreamResampler(rate, SAMPLE_RATE), StreamResampler(rate, AUDIO_RATE)
        self.audio16 = np.zeros(SAMPLE_RATE, np.float32)
        self.audio48 = np.zeros(AUDIO_RATE, np.float32)
        self.n16 = self.n48 = 0
        self.rate = rate
        self.pushes: list[tuple[int, float]] = []  # (16 kHz samples after the push, time.monotonic())
        self.ended = False
        self.final = 0  # feature steps in the table
        self.windows = 0  # windows encoded (the first resets the log-mel peak)

    def append(self, pcm: np.ndarray, now: float) -> None:
        self._add16(self.to16.push(pcm))
        self._add48(self.to48.push(pcm))
        self.pushes.append((self.n16, now))

    def end(self) -> None:
        if not self.ended:
            self._add16(self.to16.flush())
            self._add48(self.to48.flush())
            self.ended = True

    def _add16(self, x: np.ndarray) -> None:
        self.audio16 = _grow(self.audio16, self.n16 + x.size)
        self.audio16[self.n16:self.n16 + x.size] = x
        self.n16 += x.size

    def _add48(self, x: np.ndarray) -> None:
        self.audio48 = _grow(self.audio48, self.n48 + x.size)
        self.audio48[self.n48:self.n48 + x.size] = x
        self.n48 += x.size

    @property
    def steps(self) -> int | None:
        """Feature steps of the whole utterance (known once it ended): as offline, floor(n / 320), at least 1."""
        return max(1, self.n16 // SAMPLES_PER_FEATURE) if self.ended else None

    def frames(self, fps: Fraction) -> int | None:
        return num_frames(self.n16, fps) if self.ended else None

    def samples48(self, a: int, b: int) -> np.ndarray:
        """Its 48 kHz samples [a, b), zeros past what has been pushed (a copy)."""
        out = np.zeros(b - a, np.float32)
        hi = min(b, self.n48)
        if hi > a:
            out[:hi - a] = self.audio48[a:hi]
        return out

    def pushed_at(self, sample16: int) -> float | None:
        for n, t in self.pushes:
            if n > sample16:
                return t
        return self.pushes[-1][1] if self.pushes else None


def _grow(buf: np.ndarray, size: int) -> np.ndarray:
    if size <= buf.size:
        return buf
    out = np.zeros(max(size, 2 * buf.size), buf.dtype)
    out[:buf.size] = buf
    return out
