"""LipStream as a Pipecat video service: TTS audio in, lip-synced pictures and their audio out.

    pipeline = Pipeline([transport.input(), stt, user_agg, llm, tts,
                         LipStreamVideoService(engine=engine, avatar="anna"),
                         transport.output(), assistant_agg])

It sits where Pipecat's own avatar services sit (Simli, Tavus, HeyGen): between the TTS and
`transport.output()`. It takes the TTS audio (`TTSAudioRawFrame`, any rate, mono or stereo) and
gives back, per frame of the avatar's video, one `OutputImageRawFrame` and, while it speaks, the
audio of that frame as one `TTSAudioRawFrame` (48 kHz mono), at the frame's playout time.

Pictures and audio reach the viewer in step through the output transport's audio queue. Each
image is marked `sync_with_audio`, so `BaseOutputTransport` queues it behind the audio pushed
before it and shows it once that audio has been written to the transport; for WebRTC
(SmallWebRTC's audio track) a write returns when the track has taken it to send, in real time. The
service pushes frame f's picture, then frame f's audio: the picture becomes current as its own
audio starts to play, to within one transport audio chunk (`audio_out_10ms_chunks` x 10 ms; at
25 fps the default 40 ms chunk is exactly one frame's audio), and the transport's video task sends
the current picture at each tick of `video_out_framerate` (up to one frame later). Idle pictures have no audio before them and are
shown as they come, at the session's frame times. A live image queue (`video_out_is_live=True`)
would pace the pictures on a clock of their own, apart from the audio, and let them drift; and
with it on, `sync_with_audio` images are never drawn. So the transport keeps
`video_out_is_live=False` (the default), with `video_out_framerate` = the service's fps and
`video_out_width/height` = its size (a picture of another size is resized by the transport).

The engine runs in this process (`engine=`: one LiveEngine shared by every pipeline of the
process, each service opening its own session) or in a `lipstream serve` (`url=`). Both are a
`SpeakingSession` once open; everything after that is one code path.
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

from lipstream.aio import wait_for
from lipstream.errors import require
from lipstream.live.interface import SpeakingSession
from lipstream.live.items import LiveFrame, SpeechEvent
from lipstream.media.pixels import pcm16
from lipstream.media.rates import AUDIO_RATE

require("pipecat", "lipstream.integrations.pipecat")

from pipecat.frames.frames import (  # noqa: E402  (after the one-line hint that names the extra)
    CancelFrame,
    DataFrame,
    EndFrame,
    Frame,
    InterruptionFrame,
    OutputImageRawFrame,
    StartFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor, FrameProcessorSetup  # noqa: E402

if TYPE_CHECKING:
    from lipstream.live import LiveEngine  # in-process mode only: URL mode runs without torch

FRAME_KEY = "lipstream_frame"  # OutputImageRawFrame.metadata: the frame's index in its session
UTTERANCE_KEY = "lipstream_utterance"  # ...: the utterance it speaks (None when idle)
END_GRACE_S = 10.0  # EndFrame waits for the speech still queued to play out, this much past its length

_pictures: ThreadPoolExecutor | None = None


def _picture_pool() -> ThreadPoolExecutor:
    """One pool for every service of the process: I420 -> RGB runs here, off the event loop."""
    global _pictures
    if _pictures is None:
        _pictures = ThreadPoolExecutor(max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="lipstream-rgb")
    return _pictures


@dataclass
class AvatarSwitchFrame(DataFrame):
    """A camera cut: the service's session switches to another resident avatar of the same frame size
    (a close-up, a wide shot), with the speech going on. In order with the TTS audio before it; it
    lands on the frame that plays one playout delay after it reaches the service."""

    avatar: str | int = ""


def _rgb_bytes(session: SpeakingSession, frame: LiveFrame, size: tuple[int, int]) -> bytes:
    return session.rgb(frame, size).tobytes()


class LipStreamVideoService(FrameProcessor):
    """A Pipecat FrameProcessor that lip-syncs an avatar to the TTS audio passing through it.

    In: `TTSAudioRawFrame` (consumed: the speech comes back out in step with the pictures),
    `TTSStartedFrame` / `TTSStoppedFrame` (utterance boundaries; the TTSStoppedFrame is held until the
    utterance's last picture and audio went out, so the transport's bot-stopped-speaking comes when
    the avatar stops), `InterruptionFrame` (the queued speech is dropped; the next picture is idle),
    `AvatarSwitchFrame` (a camera cut; also `switch()`). Every other frame passes through unchanged,
    in order.

    The session opens in `setup()`, which the pipeline runs for its processors together before the
    StartFrame (a server's connection is made then); its pictures go out from the StartFrame on.

    Out: one `OutputImageRawFrame` a frame (RGB, `size`, `sync_with_audio`), idle pictures between
    utterances, and while speaking the frame's audio as one `TTSAudioRawFrame` after its picture.
    Each image's `metadata` holds its frame index (FRAME_KEY) and utterance (UTTERANCE_KEY).

    Without a session (the engine refused it, or the connection failed: a Pipecat error is pushed)
    the service passes everything through, so the bot still speaks, without its face.
    """

    def __init__(self, *, engine: LiveEngine | None = None, url: str | None = None, avatar: str | int,
                 api_key: str | None = None, size: tuple[int, int] | None = None,
                 fps: float | Fraction | None = None, playout_delay_s: float | None = None, **kwargs):
        """`engine` (in-process) or `url` (a running `lipstream serve`): exactly one. `avatar`: its name
        (or index in-process). `api_key`: the server's (url only). `size`: (width, height) of the pictures
        out, the transport's video_out size (None: the avatar's). `fps`: frames a second (None: the
        avatar's). `playout_delay_s`: this session's delay from speech in to its frame out (None: the
        engine's or server's). Other keyword arguments go to FrameProcessor (e.g. `name`)."""
        if (engine is None) == (url is None):
            raise ValueError("engine, url: give exactly one (engine= a LiveEngine in this process, url= a lipstream serve)")
        if engine is not None and not hasattr(engine, "open_session"):
            raise ValueError(f"engine: {type(engine).__name__}; a lipstream.live.LiveEngine is allowed")
        if url is not None and not (isinstance(url, str) and url.startswith(("http://", "https://"))):
            raise ValueError(f"url: {url!r}; an http:// or https:// address of a lipstream serve is allowed")
        if api_key is not None and url is None:
            raise ValueError("api_key: only with url= (an in-process engine has no key)")
        if not isinstance(avatar, (str, int)) or isinstance(avatar, bool) or avatar == "":
            raise ValueError(f"avatar: {avatar!r}; a resident avatar's name (or index) is allowed")
        if url is not None and not isinstance(avatar, str):
            raise ValueError(f"avatar: {avatar!r}; with url= the avatar's name is allowed")
        if size is not None:
            ok = isinstance(size, (tuple, list)) and len(size) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) and 16 <= v <= 4096 for v in size)
            if not ok:
                raise ValueError(f"size: {size!r}; (width, height) in pixels, 16 to 4096 each, is allowed")
            size = (int(size[0]), int(size[1]))
        if fps is not None:
            try:
                fps = Fraction(fps).limit_denominator(1001)
            except (TypeError, ValueError):
                raise ValueError(f"fps: {fps!r}; a number from 1 to 60 is allowed") from None
            if not 1 <= fps <= 60:
                raise ValueError(f"fps: {float(fps):g}; 1 to 60 is allowed")
        if playout_delay_s is not None and not (isinstance(playout_delay_s, (int, float))
                                                and 0.05 <= playout_delay_s <= 5):
            raise ValueError(f"playout_delay_s: {playout_delay_s!r}; 0.05 to 5 s is allowed")
        super().__init__(**kwargs)
        self._engine, self._url, self._avatar, self._api_key = engine, url, avatar, api_key
        self._want_size, self._want_fps, self._playout_delay_s = size, fps, playout_delay_s
        self._session: SpeakingSession | None = None
        self._size: tuple[int, int] | None = None
        self._reader: asyncio.Task | None = None
        self._opened: asyncio.Event | None = None  # set once opening the session has succeeded or failed
        self._closing = False
        # utterance bookkeeping, all on the event loop: the held TTSStoppedFrames in order, each with
        # whether it waits for an utterance's "finished" (False: no speech of its own, it follows the one before)
        self._stops: deque[tuple[TTSStoppedFrame | None, bool]] = deque()
        self._played_out: asyncio.Event | None = None  # set while no utterance is waiting to finish
        self._open_utterance = False  # audio pushed since the last boundary
        self._in_tts = False  # between a TTSStartedFrame and its TTSStoppedFrame
        self._rate = 0  # the open utterance's sample rate (a change starts a new utterance in the session)
        self._pending_s = 0.0  # seconds of speech pushed and not yet finished (EndFrame's wait)
        self._clears = 0  # interrupts so far: a picture made across one is stale
        self._draining = False  # after an interrupt, until the first idle frame: what comes is stale
        self._open_error: Exception | None = None  # why setup() could not open the session (said at the StartFrame)

    @property
    def session(self) -> SpeakingSession | None:
        """The session this service speaks through (None before StartFrame, or if it failed to open)."""
        return self._session

    @property
    def size(self) -> tuple[int, int] | None:
        """(width, height) of the pictures out, known once the session is open."""
        return self._size

    # --- frames in --------------------------------------------------------------------------------

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, StartFrame):
            await self.push_frame(frame, direction)  # first: processors after us drop what comes before it
            await self._start()
        elif isinstance(frame, EndFrame):
            await self._end()
            await self.push_frame(frame, direction)
        elif isinstance(frame, CancelFrame):
            await self._close()
            await self.push_frame(frame, direction)
        elif isinstance(frame, InterruptionFrame):
            await self._interrupt(frame, direction)
        elif direction != FrameDirection.DOWNSTREAM:
            await self.push_frame(frame, direction)
        elif isinstance(frame, TTSAudioRawFrame):
            await self._speech(frame)
        elif isinstance(frame, TTSStartedFrame):
            await self._utterance_starts(frame)
        elif isinstance(frame, TTSStoppedFrame):
            await self._utterance_stops(frame)
        elif isinstance(frame, AvatarSwitchFrame):
            await self.switch(frame.avatar)
        else:
            await self.push_frame(frame, direction)

    async def _ready(self) -> SpeakingSession | None:
        if self._opened is not None:
            await self._opened.wait()
        return None if self._closing else self._session

    async def _speech(self, frame: TTSAudioRawFrame) -> None:
        session = await self._ready()
        if session is None:
            await self.push_frame(frame)
            return
        if not self._in_tts and not np.frombuffer(frame.audio, np.int16).any():
            return  # silence outside a TTS response (a TTS's padding after its stop) would open an utterance no stop ends
        if self._open_utterance and frame.sample_rate != self._rate:
            self._boundary(None)  # the session starts a new utterance at a new rate: hold a place for its end
        try:
            session.push_audio(frame.audio, frame.sample_rate, channels=frame.num_channels)
        except Exception as e:  # noqa: BLE001 (a closed session, a bad frame: a Pipecat error, not a dead pipeline)
            await self.push_error(f"LipStream: the session did not take the audio: {e}", exception=e)
            return
        self._open_utterance, self._rate = True, frame.sample_rate
        self._pending_s += len(frame.audio) / (2 * frame.num_channels * frame.sample_rate)

    async def _utterance_starts(self, frame: TTSStartedFrame) -> None:
        session = await self._ready()
        if session is not None and self._open_utterance:
            self._boundary(None)  # audio came without a stop: end it before the next response
        self._in_tts = True
        await self.push_frame(frame)

    async def _utterance_stops(self, frame: TTSStoppedFrame) -> None:
        session = await self._ready()
        self._in_tts = False
        if session is None:
            await self.push_frame(frame)
        elif self._open_utterance:
            self._boundary(frame)
        elif self._stops:
            self._stops.append((frame, False))  # no speech of its own: it goes out after the one held before it
        else:
            await self.push_frame(frame)

    def _boundary(self, stop: TTSStoppedFrame | None) -> None:
        """End the open utterance; `stop` goes downstream once its last frame has gone out."""
        self._session.end_utterance()
        self._open_utterance = False
        self._stops.append((stop, True))
        self._played_out.clear()

    async def switch(self, avatar: str | int) -> int | None:
        """A camera cut to another resident avatar of the same frame size (its name; in-process also its
        index): the frame it lands on (None: a server's session, which answers on its socket). A
        refusal is a Pipecat error; the session plays on as it was."""
        session = await self._ready()
        if session is None:
            return None
        try:
            return session.switch(avatar)
        except Exception as e:  # noqa: BLE001 (another frame size, not resident, a closed session: reported)
            await self.push_error(f"LipStream: the session did not switch to {avatar!r}: {e}", exception=e)
            return None

    async def _interrupt(self, frame: InterruptionFrame, direction: FrameDirection) -> None:
        if self._session is not None and not self._closing:
            try:
                self._session.clear()
            except Exception as e:  # noqa: BLE001 (a remote session's connection lost: reported, the frame goes on)
                await self.push_error(f"LipStream: the session could not be interrupted: {e}", exception=e)
            self._clears += 1
            self._draining = True
        self._open_utterance = self._in_tts = False
        held = [stop for stop, _ in self._stops if stop is not None]
        self._stops.clear()
        self._pending_s = 0.0
        if self._played_out is not None:
            self._played_out.set()
        await self.push_frame(frame, direction)
        for stop in held:  # their speech was dropped: nothing more to wait for
            await self.push_frame(stop)

    # --- the session --------------------------------------------------------------------------------

    async def setup(self, setup: FrameProcessorSetup):
        """Open the session here (a server's connection included), beside the other processors' set-up."""
        await super().setup(setup)
        await self._open()

    async def _start(self) -> None:
        """StartFrame: the session opened in setup() (or now, where no setup ran) starts handing out pictures."""
        await self._open()
        if self._open_error is not None:
            e, self._open_error = self._open_error, None
            await self.push_error(f"LipStream: no session for avatar {self._avatar!r} ({type(e).__name__}: {e}); "
                                  "the speech passes through without the avatar", exception=e)
        if self._session is not None and self._reader is None:
            self._reader = self.create_task(self._read(self._session), name=f"{self}::read")

    async def _open(self) -> None:
        if self._opened is not None:
            await self._opened.wait()
            return
        self._opened, self._played_out = asyncio.Event(), asyncio.Event()
        self._played_out.set()
        try:
            if self._engine is not None:
                session = self._engine.open_session(self._avatar, fps=self._want_fps, encode=False,
                                                    playout_delay_s=self._playout_delay_s)
            else:
                from lipstream.client import connect

                session = await connect(self._url, self._avatar, api_key=self._api_key, fps=self._want_fps,
                                        playout_delay_s=self._playout_delay_s)
        except Exception as e:  # noqa: BLE001 (SessionRefused, an unknown avatar, no server: said at the StartFrame)
            self._open_error = e
            self._opened.set()
            return
        self._session = session
        self._size = self._want_size or tuple(session.size)
        self._opened.set()

    async def _end(self) -> None:
        """EndFrame: the speech still queued plays out (as a transport drains its audio), then the session closes."""
        session = await self._ready()
        if session is not None:
            if self._open_utterance:
                self._boundary(None)
            try:
                await wait_for(self._played_out.wait(), self._pending_s + END_GRACE_S)
            except TimeoutError:
                await self.push_error("LipStream: the queued speech did not finish playing before the end")
        await self._close()

    async def _close(self) -> None:
        """Close the session and stop reading it. Idempotent (EndFrame, CancelFrame, cleanup)."""
        self._closing = True
        session, self._session = self._session, None
        if session is not None:
            try:
                await session.aclose()  # a remote session lets its server go before it returns
            except Exception as e:  # noqa: BLE001 (closing is best effort: the session is gone either way)
                await self.push_error(f"LipStream: closing the session failed: {e}", exception=e)
        reader, self._reader = self._reader, None
        if reader is not None and reader is not asyncio.current_task():
            await self.cancel_task(reader)
        if self._opened is not None:
            self._opened.set()
        if self._played_out is not None:
            self._played_out.set()

    async def cleanup(self):
        await super().cleanup()
        await self._close()

    # --- frames out ---------------------------------------------------------------------------------

    async def _read(self, session: SpeakingSession) -> None:
        """The session's frames, at their playout times, as pictures and audio; its events release the stops."""
        try:
            async for item in session:
                if isinstance(item, LiveFrame):
                    await self._frame_out(session, item)
                elif isinstance(item, SpeechEvent) and item.kind == "finished" and not self._draining:
                    await self._finished()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 (a lost connection, a stopped engine: reported, not a dead task)
            if not self._closing:
                await self.push_error(f"LipStream: the session failed ({type(e).__name__}: {e})", exception=e)
            return
        if not self._closing:
            await self.push_error("LipStream: the session closed; the speech passes through without the avatar")
            self._session = None
            self._stops.clear()
            self._played_out.set()

    async def _frame_out(self, session: SpeakingSession, frame: LiveFrame) -> None:
        speaking = frame.utterance is not None
        if speaking and self._draining:
            return  # handed out before the interrupt reached the session
        clears = self._clears
        image = await asyncio.get_running_loop().run_in_executor(_picture_pool(), _rgb_bytes, session, frame,
                                                                 self._size)
        if speaking and clears != self._clears:
            return  # interrupted while its picture was being made
        if not speaking:
            self._draining = False
        picture = OutputImageRawFrame(image=image, size=self._size, format="RGB")
        picture.sync_with_audio = True
        picture.metadata[FRAME_KEY] = frame.frame
        picture.metadata[UTTERANCE_KEY] = frame.utterance
        await self.push_frame(picture)
        if speaking and frame.audio.size:
            await self.push_frame(TTSAudioRawFrame(audio=pcm16(frame.audio), sample_rate=AUDIO_RATE, num_channels=1))

    async def _finished(self) -> None:
        """An utterance's last frame went out: its stop (and the stops of no speech held behind it) go too."""
        if not self._stops:
            return
        stop, _ = self._stops.popleft()
        if stop is not None:
            await self.push_frame(stop)
        while self._stops and not self._stops[0][1]:
            await self.push_frame(self._stops.popleft()[0])
        if not self._stops:
            self._pending_s = 0.0
            self._played_out.set()
