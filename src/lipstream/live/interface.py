"""The one interface a speaking session plays, whichever side of a network it is on, and its one refusal.

`live.Session` (in this process, on a LiveEngine) implements it, and so does
`lipstream.client.RemoteSession` (a `lipstream serve` session over WebRTC). The Pipecat and
LiveKit integrations are written against this and nothing else, so each runs in-process or
against a server by URL.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from fractions import Fraction
from typing import Protocol, runtime_checkable

import numpy as np

from lipstream.errors import LipStreamError
from lipstream.live.items import LiveFrame, SessionStats, SpeechEvent


class SessionRefused(LipStreamError):
    """A session could not be opened, said in one line: the live engine's, the server's and a remote client's.

    `status` says why as HTTP does: 503 full (admitting it would make the others miss their deadlines) or
    no room, 422 a bad request or offer, 401/403 the key, 404 an unknown avatar; None: no server answered.
    `detail` is the reason."""

    def __init__(self, status: int | None, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail

    def __reduce__(self):  # crosses process boundaries (Ray) whole
        return type(self), (self.status, self.detail)


@runtime_checkable
class SpeakingSession(Protocol):
    fps: Fraction  # frames a second it hands out
    size: tuple[int, int]  # (width, height) of its pictures
    matrix: str  # the colour matrix its I420 is in: "bt601" (untagged video's) or "bt709"

    def push_audio(self, pcm: np.ndarray | bytes, rate: int, *, channels: int = 1) -> None:
        """Speech of the current utterance (opens one): float, int16 or PCM16 bytes, any rate."""

    def end_utterance(self) -> None:
        """The utterance is complete: its last frames need no more audio."""

    def clear(self) -> None:
        """Interrupt: queued speech dropped, the next frame handed out is idle."""

    def switch(self, avatar: int | str) -> int | None:
        """A camera cut to another resident avatar of the same frame size, with the speech going on: the
        frame it lands on where known at once (a local session), else None (a remote one: its server
        answers on the speech socket)."""

    @property
    def stats(self) -> SessionStats:
        """Its counters (a remote session: what its client saw)."""

    def rgb(self, frame: LiveFrame, size: tuple[int, int] | None = None, out_format: str = "RGB") -> np.ndarray:
        """A frame's picture, [h, w, 3] uint8 (4 for RGBA)."""

    def close(self) -> None:
        """Its stream ends (iteration stops) and its place is freed. Idempotent."""

    async def aclose(self) -> None:
        """close(), returning once its place is free (a remote session: once its server has let it go)."""

    def __aiter__(self) -> AsyncIterator[LiveFrame | SpeechEvent]:
        """Frames at their playout times (each with its 48 kHz audio) and speech events."""
