"""One live session: speech in as it arrives, lip-synced frames out at the avatar's frame rate.

A session keeps a timeline (`SessionClock`). Frame f plays at `t0 + delay + f / fps` (its
deadline). Speech pushed at wall time t starts at the first frame whose media time `f / fps` is
not before `t - t0`, so it plays `delay` after it was pushed; between utterances the idle loop
plays (the mouth at rest).

A session is three parts, split along the threads that drive them, each the only owner of its
state, with the hand-offs between them explicit:

- `SpeechRequest` (live/request.py): the speech, the features' progress, the next frame to plan,
  the generation. The caller's pushes and the engine's core thread, through its lock.
- `FrameHandoff` (live/handoff.py): rendered frames copied out and encoded in frame order. The
  copy pool and the encode pool's reader thread; the core delivers into it.
- `Playout` (live/playout.py): frames handed out at their playout times, speech events, the audio
  out. The consumer's event loop; the hand-off passes it frames through its inbox.

This class is what a caller holds, and the stable surface the integrations (Pipecat, LiveKit)
are built on: push, end and clear from any thread, read with `async for item in session`
(LiveFrame | SpeechEvent), `rgb(frame)` for a picture, `close()` when done (docs/live.md).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from lipstream.live.handoff import FrameHandoff
from lipstream.live.items import TIMING_STAGES, LiveFrame, SessionStats, SpeechEvent
from lipstream.live.options import LiveOptions
from lipstream.live.playout import Playout
from lipstream.live.request import SpeechRequest
from lipstream.media.pixels import i420_to_rgb, mono_pcm


class Session:
    """Made by LiveEngine.open_session. Thread-safe: push, end and clear from any thread."""

    def __init__(self, request: SpeechRequest, handoff: FrameHandoff, playout: Playout, options: LiveOptions,
                 size: tuple[int, int], wake_core: Callable[[], None], now: Callable[[], float],
                 matrix: str = "bt601", release: Callable[[Session], None] = lambda session: None,
                 switch: Callable[[Session, int | str], int] | None = None):
        self.request, self.handoff, self.playout = request, handoff, playout
        self.id, self.clock, self.fps = request.id, request.clock, request.fps
        self.o, self.size, self.matrix = options, size, matrix  # size: (width, height); matrix: its I420's
        self._wake_core, self._now, self._release, self._switch = wake_core, now, release, switch

    @property
    def avatar(self) -> int:
        """The engine's index of the avatar its pictures come from (the latest cut's, once reached)."""
        return self.request.avatar

    @property
    def t0(self) -> float:
        return self.clock.t0

    # --- the caller's side ---------------------------------------------------------------------

    def push_audio(self, pcm: np.ndarray | torch.Tensor | bytes, rate: int, *, channels: int = 1) -> None:
        """Samples of the current utterance; opens one if none is open. `pcm`: float in [-1, 1], int16,
        or PCM16 little-endian bytes; `channels` > 1: interleaved, mixed down to mono. Any rate from
        8 to 192 kHz. Chunks of 10-1000 ms are what it is made for; any length works.
        """
        if not 8000 <= int(rate) <= 192_000:
            raise ValueError(f"rate: {rate} Hz; 8000 to 192000 are allowed")
        # numpy only: this runs on the caller's event loop, where each torch op would drop the GIL
        x = pcm.detach().cpu().numpy() if isinstance(pcm, torch.Tensor) else pcm
        x = mono_pcm(x, channels)
        if x.ndim > 1 and 1 not in x.shape:
            raise ValueError(f"pcm: shape {tuple(np.shape(pcm))}; one channel, or interleaved channels with channels=N, is allowed")
        x = x.reshape(-1) / np.float32(32768.0) if x.dtype == np.int16 else x.astype(np.float32, copy=False).reshape(-1)
        if x.size == 0 or not np.isfinite(x).all():
            raise ValueError("pcm: empty, or holds NaN or infinite samples")
        if self.playout.closed:
            raise RuntimeError(f"session {self.id} is closed")
        self.request.push(x, int(rate), self._now())
        self._wake_core()

    def end_utterance(self) -> None:
        """The utterance is complete: its last frames can be made without waiting for more audio."""
        if self.request.end() is not None:
            self.playout.wake()  # if its last frame has played already, "finished" goes out now
        self._wake_core()

    def clear(self) -> None:
        """Interrupt: drop all queued speech; the next frame handed out is idle again."""
        at = self.playout.play_frame
        generation = self.request.clear(at)
        self.handoff.restart(at, generation)
        self.playout.interrupt(generation)
        self._wake_core()

    def switch(self, avatar: int | str) -> int:
        """A camera cut: from the next frame not yet rendered, pictures come from another resident avatar
        (its index or name) of the same frame size, with no gap and the speech going on. A cut and a push
        made at one moment land on the same frame (docs/live.md, "Camera cuts"); returns that frame.
        ValueError: not resident, or another frame size or colour matrix."""
        if self._switch is None:
            raise RuntimeError("this session was not opened by a LiveEngine: it cannot switch avatars")
        if self.playout.closed:
            raise RuntimeError(f"session {self.id} is closed")
        return self._switch(self, avatar)

    def request_keyframe(self) -> None:
        """The next frame handed to the encoder is an IDR (a viewer lost packets)."""
        self.handoff.want_keyframe()

    def close(self) -> None:
        """End the stream: the reader's iteration stops and its place on the engine is freed. Idempotent."""
        self.playout.close()
        self.handoff.close()
        release, self._release = self._release, lambda session: None
        release(self)

    async def aclose(self) -> None:
        """close() (a local session's place is free at once): the SpeakingSession call a remote one needs."""
        self.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self.playout.closed

    def rgb(self, frame: LiveFrame, size: tuple[int, int] | None = None, out_format: str = "RGB") -> np.ndarray:
        """A frame's picture as [h, w, 3] uint8 RGB ("RGBA": 4), in this avatar's colour matrix, resized
        to `size` (width, height) if given. OpenCV, without the GIL: call it on a worker thread."""
        return i420_to_rgb(frame.i420, self.matrix, size, out_format)

    # --- the consumer's side -------------------------------------------------------------------

    def __aiter__(self) -> Playout:
        return self.playout

    async def __anext__(self) -> LiveFrame | SpeechEvent:
        return await self.playout.__anext__()

    # --- what it did ---------------------------------------------------------------------------

    @property
    def stats(self) -> SessionStats:
        """Its counters, each from the part that keeps it."""
        p, r = self.playout, self.request
        return SessionStats(rendered=p.rendered, played=p.played, late=p.late, late_speech=p.late_speech,
                            arrived_after_play=p.arrived_after_play, skipped=r.skipped, underruns=r.underruns,
                            dropped_unread=p.dropped_unread, audio_late_samples=self.handoff.audio_late_samples)

    @property
    def timings(self) -> list[tuple[float, ...]]:
        """Per speech frame kept (seconds, by items.TIMING_STAGES)."""
        return self.handoff.kept_timings()

    def timings_ms(self) -> dict[str, list[float]]:
        """The kept speech frames' timings by stage (ms; "slack" < 0: ready after its deadline)."""
        rows = self.timings
        return {name: [round(r[i] * 1000, 2) for r in rows] for i, name in enumerate(TIMING_STAGES)}
