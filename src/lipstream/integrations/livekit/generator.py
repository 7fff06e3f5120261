"""A LipStream session as LiveKit's `VideoGenerator`: what `AvatarRunner` reads and publishes.

AvatarRunner (livekit.agents.voice.avatar) pushes the agent's speech in (`push_audio`, an
`AudioSegmentEnd` when a reply is complete), calls `clear_buffer` on an interruption, and reads
`async for item in generator`, handing each item to its `rtc.AVSynchronizer`. It keeps the
playback position itself: the duration of the `rtc.AudioFrame`s read since the last segment
began, reported with `lk.playback_finished` when an `AudioSegmentEnd` comes back (interrupted=False)
or when it clears (interrupted=True). So what this yields is exactly what plays:

- every frame's picture (`rtc.VideoFrame`, RGBA) at the session's playout time, idle or speaking;
- a speaking frame's audio (48 kHz mono PCM16) right after its picture, and nothing for an idle one;
- `AudioSegmentEnd` after an utterance's last frame (the session's "finished" event).

On `clear_buffer` the runner reports the position it has counted, then starts counting from zero.
So no audio of the cleared speech is yielded after it (a picture being converted when it came is
dropped, and so is the "finished" of a cleared utterance), and a clear that comes while the runner
is still pushing a frame's audio into its synchronizer (it blocks there up to a frame, the audio
source playing in real time) waits for that push: the runner counts that audio before it reports,
not into the next reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from concurrent.futures import Executor, ThreadPoolExecutor

import numpy as np
from livekit import rtc
from livekit.agents.voice.avatar import AudioSegmentEnd, AvatarOptions, VideoGenerator

from lipstream.aio import wait_for
from lipstream.live.interface import SpeakingSession
from lipstream.live.items import LiveFrame, SpeechEvent
from lipstream.media.pixels import i420_resize, pcm16
from lipstream.media.rates import AUDIO_RATE

_POOL: ThreadPoolExecutor | None = None
CLEAR_WAIT_S = 1.0  # at most this long for the runner to finish pushing the audio it holds


def picture_pool() -> ThreadPoolExecutor:
    """The threads every generator in this process converts its pictures on (OpenCV drops the GIL there)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max(2, min(8, (os.cpu_count() or 2) // 2)), thread_name_prefix="lipstream-lk-rgba")
    return _POOL


class LipStreamVideoGenerator(VideoGenerator):
    """`VideoGenerator` over a SpeakingSession (a local `live.Session` or a remote one).

    `size` (width, height): the pictures' size (None: the session's). `pool`: where pictures are
    converted (None: one pool shared by the process). The session is the caller's: close it after
    the runner stops.
    """

    def __init__(self, session: SpeakingSession, *, size: tuple[int, int] | None = None, pool: Executor | None = None):
        if size is not None and (len(size) != 2 or min(size) < 16 or max(size) > 4096 or size[0] % 2 or size[1] % 2):
            raise ValueError(f"size: {size!r}; (width, height), even, 16 to 4096 pixels, is allowed")
        self.session = session
        self.size = tuple(size) if size is not None else tuple(session.size)
        self._pool = pool or picture_pool()
        self._generation = 0  # clear_buffer calls so far: what was read before one is not played after it
        self._cleared_through = -1  # utterances up to this id were cleared: their "finished" is not a segment end
        self._newest = -1  # the newest utterance seen in a frame
        self.last_frame: LiveFrame | None = None  # the LiveFrame whose picture was yielded last
        self._audio_held: asyncio.Event | None = None  # set when the runner is done with the audio yielded last

    def avatar_options(self) -> AvatarOptions:
        """What AvatarRunner's sources and synchronizer need: this size, the session's fps, 48 kHz mono."""
        w, h = self.size
        return AvatarOptions(video_width=w, video_height=h, video_fps=float(self.session.fps),
                             audio_sample_rate=AUDIO_RATE, audio_channels=1)

    async def push_audio(self, frame: rtc.AudioFrame | AudioSegmentEnd) -> None:
        if isinstance(frame, AudioSegmentEnd):
            self.session.end_utterance()
            return
        self.session.push_audio(bytes(frame.data), frame.sample_rate, channels=frame.num_channels)

    async def clear_buffer(self) -> None:
        self._generation += 1
        self._cleared_through = self._newest
        self.session.clear()
        held = self._audio_held
        if held is not None:  # the runner counts that audio when its push returns: let it, then it reports
            with contextlib.suppress(TimeoutError):
                await wait_for(held.wait(), CLEAR_WAIT_S)

    def __aiter__(self) -> AsyncIterator[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[rtc.VideoFrame | rtc.AudioFrame | AudioSegmentEnd]:
        loop = asyncio.get_running_loop()
        async for item in self.session:
            if isinstance(item, SpeechEvent):
                if item.kind == "finished" and item.utterance > self._cleared_through:
                    yield AudioSegmentEnd()
                continue
            generation = self._generation
            if item.utterance is not None:
                self._newest = max(self._newest, item.utterance)
            picture = await loop.run_in_executor(self._pool, self._picture, item)
            if generation != self._generation:
                continue  # cleared while it was converted: the next frame is idle
            self.last_frame = item
            yield picture
            # the runner may have waited on its synchronizer after the picture: a clear since then
            # means this frame's speech is not to be counted as played
            if item.utterance is not None and item.audio.size and generation == self._generation:
                held = self._audio_held = asyncio.Event()
                try:
                    yield rtc.AudioFrame(pcm16(item.audio), AUDIO_RATE, 1, item.audio.size)
                finally:  # the runner asked for the next item (or stopped reading)
                    self._audio_held = None
                    held.set()

    def _picture(self, frame: LiveFrame) -> rtc.VideoFrame:
        """On a pool thread: the frame as a VideoFrame of this generator's size. BT.601 pictures go as
        the session's own I420 (what LiveKit's encoder takes: no conversion here, none in the FFI; RGBA
        cost a conversion on a pool thread and another in the FFI's capture, on the event loop's
        thread); other matrices as RGBA converted with theirs, since WebRTC's receivers assume BT.601."""
        w, h = self.size
        if getattr(self.session, "matrix", "bt601") == "bt601":
            i420 = np.ascontiguousarray(i420_resize(frame.i420, self.size))
            return rtc.VideoFrame(w, h, rtc.VideoBufferType.I420, i420.data)
        rgba = self.session.rgb(frame, self.size, "RGBA")
        return rtc.VideoFrame(w, h, rtc.VideoBufferType.RGBA, rgba.data)
