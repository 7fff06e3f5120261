"""A `lipstream serve` session over WebRTC, held like a local one: `session = await connect(url, "anna")`.

`RemoteSession` implements `lipstream.live.SpeakingSession`, as a local `live.Session` does, so the
Pipecat and LiveKit integrations take either. Speech goes up the session's WebSocket as PCM16 (the
server takes any rate); the presenter comes back as aiortc's video (H.264, the server's own packets)
and audio (Opus) tracks. Each picture's frame index is its RTP time (aiortc counts both tracks from
their first packet, which is the session's frame 0 and audio sample 0: the server paces both from
frame 0's playout time), so a frame's 48 kHz samples are cut from the audio track by the same clock
the server cut them by. A frame is handed out once its audio is in (or AUDIO_WAIT_S after its
picture); a frame the server played late, with no picture sent, is handed out as the previous
picture (`late`), as a local session does. Speech events come from the WebSocket and go out in the
same place among the frames as a local session's: "started" and "interrupted" before their frame,
"finished" after it; a frame's `utterance` is read from them.

No torch: a client costs what a client costs (aiortc, PyAV, numpy, httpx, websockets).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from lipstream.aio import wait_for
from lipstream.client.jobs import key_refusal
from lipstream.errors import LipStreamError, require
from lipstream.live.interface import SessionRefused
from lipstream.live.items import LiveFrame, SessionClock, SessionStats, SpeechEvent
from lipstream.media.pixels import i420_to_rgb, mono_pcm, pcm16
from lipstream.media.rates import AUDIO_RATE, as_fps

require("serve", "lipstream.client", "httpx", "aiortc", "websockets")

import httpx  # noqa: E402  (after the one-line hint that names the extra)

log = logging.getLogger(__name__)

RTP_VIDEO_CLOCK = 90_000
AUDIO_WAIT_S = 0.25  # a picture whose audio is not all in this long after it arrived goes with what is
LATE_WAIT_S = 0.5  # audio this far past a frame whose picture never came: the server played it late
KEEP_PICTURES = 200  # pictures held for a consumer that is not reading (the oldest go first)
KEEP_EVENTS = 256
CHUNK_S = 1.0  # a long push goes up in messages of at most this much audio
TRACKS_TIMEOUT_S = 30.0


@dataclass
class _Picture:
    i420: np.ndarray
    arrived: float  # time.monotonic()


class _AudioTimeline:
    """The audio track's 48 kHz mono samples by their index in the session (the track's first = 0)."""

    def __init__(self, keep: int = 10 * AUDIO_RATE):
        self.chunks: deque[tuple[int, np.ndarray]] = deque()
        self.end = 0  # one past the last sample received
        self.keep = keep

    def put(self, start: int, samples: np.ndarray) -> None:
        self.chunks.append((start, samples))
        self.end = max(self.end, start + samples.size)
        while self.chunks and self.chunks[0][0] < self.end - self.keep:
            self.chunks.popleft()

    def take(self, a: int, b: int) -> np.ndarray:
        """Samples [a, b), zeros where none came; what ends before `a` is let go."""
        out = np.zeros(b - a, np.float32)
        while self.chunks and self.chunks[0][0] + self.chunks[0][1].size <= a:
            self.chunks.popleft()
        for start, x in self.chunks:
            lo, hi = max(start, a), min(start + x.size, b)
            if lo < hi:
                out[lo - a:hi - a] = x[lo - start:hi - start]
        return out


def _reason(r: httpx.Response) -> str:
    try:
        detail = r.json().get("detail")
    except ValueError:
        detail = None
    return str(detail or r.text.strip() or r.reason_phrase).splitlines()[0][:300]


def _check_size(size) -> tuple[int, int] | None:
    if size is None:
        return None
    try:
        w, h = (int(v) for v in size)
    except (TypeError, ValueError):
        raise ValueError(f"size: {size!r}; (width, height) in pixels is allowed") from None
    if w < 2 or h < 2 or w % 2 or h % 2:
        raise ValueError(f"size: {size!r}; even widths and heights of 2 or more are allowed (I420)")
    return w, h


async def connect(url: str, avatar: str, *, api_key: str | None = None, fps=None,
                  playout_delay_s: float | None = None, size=None, latency: str | None = None) -> RemoteSession:
    """Open a live session on `avatar` of the `lipstream serve` at `url` (http://host:port), as a WebRTC
    client. `api_key`: the server's bearer key, if it has keys. `fps` (None: the avatar's): the session's
    frame rate. `playout_delay_s` (None: the server's): how far behind the speech it plays.
    `size` (width, height; None: the avatar's): the pictures handed out, scaled at the client. `latency`
    ("low"; None: the server's): the session's latency choice (docs/live.md, "Low latency").
    Raises SessionRefused (naming the URL and the server's reason) with nothing left open."""
    from aiortc import RTCPeerConnection, RTCRtpReceiver, RTCSessionDescription

    url = url.rstrip("/")
    size = _check_size(size)
    rate = None if fps is None else as_fps(fps)
    if playout_delay_s is not None and not 0.05 <= playout_delay_s <= 5:
        raise ValueError(f"playout_delay_s: {playout_delay_s:g}; 0.05 to 5 s is allowed")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    http = httpx.AsyncClient(base_url=url, headers=headers, timeout=30)
    pc = None
    try:
        r = await http.get("/v1/avatars")
        if r.status_code in (401, 403):
            raise SessionRefused(r.status_code, key_refusal(url, r.status_code, bool(api_key), "pass api_key=KEY"))
        if r.status_code != 200:
            raise SessionRefused(r.status_code, f"{url}: GET /v1/avatars answered {r.status_code}: {_reason(r)}")
        info = next((a for a in r.json() if a["name"] == avatar), None)
        if info is None:
            names = ", ".join(a["name"] for a in r.json()) or "none"
            raise SessionRefused(404, f"{url}: avatar {avatar!r} is not resident (the server has: {names})")
        pc = RTCPeerConnection()
        pc.addTransceiver("audio", direction="recvonly")
        video = pc.addTransceiver("video", direction="recvonly")
        codecs = RTCRtpReceiver.getCapabilities("video").codecs  # H.264 first: the server sends its own packets
        video.setCodecPreferences(sorted(codecs, key=lambda c: c.mimeType.lower() != "video/h264"))
        session = RemoteSession(url, avatar, http, pc, Fraction(rate or Fraction(info["fps"])).limit_denominator(1001),
                                size or (int(info["width"]), int(info["height"])), scale=size is not None)
        await pc.setLocalDescription(await pc.createOffer())
        params = {"avatar": avatar}
        if rate is not None:
            params["fps"] = str(rate)
        if playout_delay_s is not None:
            params["playout_delay_ms"] = round(playout_delay_s * 1000, 3)
        if latency is not None:
            params["latency"] = latency
        r = await http.post("/v1/sessions", params=params, content=pc.localDescription.sdp,
                            headers={"Content-Type": "application/sdp"})
        if r.status_code != 201:
            raise SessionRefused(r.status_code, f"{url}: the server refused a session on {avatar!r} ({r.status_code}): "
                                 f"{_reason(r)}")
    except httpx.TransportError as e:
        await _discard(pc, http)
        raise SessionRefused(None, f"{url}: the server cannot be reached ({type(e).__name__}: {e})") from None
    except BaseException:
        await _discard(pc, http)
        raise
    session.id = r.headers["x-session-id"]
    try:
        await pc.setRemoteDescription(RTCSessionDescription(r.text, "answer"))
        await session._open_speech(headers)
    except BaseException as e:
        await session.aclose()
        if isinstance(e, Exception) and not isinstance(e, LipStreamError):
            raise SessionRefused(None, f"{url}: session {session.id} could not be set up ({type(e).__name__}: {e})") from e
        raise
    return session


async def _discard(pc, http: httpx.AsyncClient) -> None:
    if pc is not None:
        await pc.close()
    await http.aclose()


class RemoteSession:
    """A `lipstream serve` session, through `connect`. Push, end and clear from the event loop (or any
    thread); read with `async for item in session` (LiveFrame | SpeechEvent); `close()` (or `aclose()`)."""

    def __init__(self, url: str, avatar: str, http: httpx.AsyncClient, pc, fps: Fraction, size: tuple[int, int],
                 scale: bool = False):
        self.url, self.avatar, self.fps, self.size = url, avatar, fps, size
        self.id = ""
        self.matrix = "bt601"  # the colour matrix its pictures are in: the stream's tag (BT.709 if it says so)
        self.played = self.late = self.late_speech = 0  # counted at this client (stats)
        self._http, self._pc, self._ws = http, pc, None
        self._scale = scale
        self._clock = SessionClock(0.0, 0.0, fps)  # only its frame -> audio sample arithmetic is used
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._outbox: asyncio.Queue = asyncio.Queue()  # to the WebSocket: bytes (PCM16) or str (a command)
        self._rate: int | None = None  # the rate the server was last told
        self._pictures: dict[int, _Picture] = {}
        self._audio = _AudioTimeline()
        self._events: deque[SpeechEvent] = deque()  # arrived, not handed out yet
        self._spans: dict[int, list] = {}  # utterance -> [first frame, one past its last (None: still speaking)]
        self._out: deque = deque()
        self._next: int | None = None  # the next frame to hand out (None: no picture has come yet)
        self._last: np.ndarray | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._tracks_ended = 0
        self._closed = False
        self._closing: asyncio.Task | None = None
        self.error: str | None = None  # the last error the server sent on the WebSocket, or why it ended the session
        self.cuts: list[dict] = []  # the server's answers to `switch` ("switched" with its frame, or "switch_refused")
        self._refused: SessionRefused | None = None  # why the server closed the speech socket, once it has
        pc.on("track", self._on_track)

    # --- set-up ----------------------------------------------------------------------------------

    def _on_track(self, track) -> None:
        reader = self._read_video if track.kind == "video" else self._read_audio
        self._tasks.append(asyncio.ensure_future(reader(track)))

    async def _open_speech(self, headers: dict) -> None:
        import websockets

        ws_url = "ws" + self.url[4:] + f"/v1/sessions/{self.id}/speech"
        try:
            self._ws = await websockets.connect(ws_url, additional_headers=headers, max_size=None)
        except websockets.InvalidStatus as e:  # a server before close codes: a bare 403 at the handshake
            status = e.response.status_code
            raise SessionRefused(status, f"{self.url}: session {self.id}: the server refused its speech socket "
                                         f"({status}): a wrong key, or no such session") from None
        self._tasks += [asyncio.ensure_future(self._send_speech()), asyncio.ensure_future(self._read_events())]

    # --- the caller's side -----------------------------------------------------------------------

    def push_audio(self, pcm: np.ndarray | bytes, rate: int, *, channels: int = 1) -> None:
        """Speech of the current utterance (opens one): float in [-1, 1], int16 or PCM16 bytes, any rate from
        8 to 192 kHz, `channels` interleaved (mixed down). Sent in order, from the event loop."""
        if not 8000 <= int(rate) <= 192_000:
            raise ValueError(f"rate: {rate} Hz; 8000 to 192000 are allowed")
        self._check_socket()
        x = mono_pcm(pcm, channels)
        if x.ndim > 1 and 1 not in x.shape:
            raise ValueError(f"pcm: shape {tuple(np.shape(pcm))}; one channel, or interleaved channels with channels=N, is allowed")
        x = x.reshape(-1)
        if x.size == 0 or (x.dtype != np.int16 and not np.isfinite(x).all()):
            raise ValueError("pcm: empty, or holds NaN or infinite samples")
        if self._closed:
            raise RuntimeError(f"session {self.id} is closed")
        data = x.astype("<i2").tobytes() if x.dtype == np.int16 else pcm16(x)
        rate, step = int(rate), 2 * max(1, int(rate * CHUNK_S))
        if rate != self._rate:
            self._rate = rate
            self._send(json.dumps({"type": "start", "rate": rate}))
        for i in range(0, len(data), step):
            self._send(data[i:i + step])

    def end_utterance(self) -> None:
        """The utterance is complete: its last frames need no more audio."""
        self._check_socket()
        if not self._closed:
            self._send(json.dumps({"type": "end"}))

    def clear(self) -> None:
        """Interrupt: the server drops the queued speech; frames it plays from now on are idle (those
        already on their way still arrive, as they played)."""
        self._check_socket()
        if not self._closed:
            self._send(json.dumps({"type": "interrupt"}))

    def switch(self, avatar: int | str) -> None:
        """A camera cut to another avatar resident on the server, of the same frame size: sent with the
        speech, in order. The server's answer lands in `cuts` (the frame it lands on), or, refused, in
        `error` as well."""
        if not isinstance(avatar, str):
            raise ValueError(f"avatar: {avatar!r}; a remote session switches by the avatar's name")
        self._check_socket()
        if not self._closed:
            self._send(json.dumps({"type": "switch", "avatar": avatar}))

    async def aswitch(self, avatar: str, timeout_s: float = 5.0) -> int:
        """switch(), then the server's answer: the frame the cut lands on. ValueError with the server's
        reason if it refused (another frame size, not resident); TimeoutError if no answer came."""
        seen = len(self.cuts)
        self.switch(avatar)
        until = time.monotonic() + timeout_s
        while len(self.cuts) == seen:
            if time.monotonic() > until or self._closed:
                raise TimeoutError(f"{self.url}: session {self.id}: no answer to the switch to {avatar!r}")
            await asyncio.sleep(0.01)
        answer = self.cuts[seen]
        if answer["type"] != "switched":
            raise ValueError(answer.get("message") or f"the server refused the switch to {avatar!r}")
        return int(answer["frame"])

    def rgb(self, frame: LiveFrame, size: tuple[int, int] | None = None, out_format: str = "RGB") -> np.ndarray:
        """A frame's picture as [h, w, 3] uint8 RGB ("RGBA": 4) in the stream's colour matrix, resized to
        `size` (width, height) if given. OpenCV, without the GIL: call it on a worker thread."""
        return i420_to_rgb(frame.i420, self.matrix, size, out_format)

    def close(self) -> None:
        """End the stream (iteration stops) and the session on the server (DELETE; in the background from a
        sync caller: `await session.aclose()` waits for it). Idempotent."""
        self._closed = True
        self._loop.call_soon_threadsafe(self._wake.set)
        if self._closing is None:
            if threading.get_ident() == self._loop_thread:
                self._closing = self._loop.create_task(self._shutdown())
            elif self._loop.is_running():
                asyncio.run_coroutine_threadsafe(self.aclose(), self._loop)

    async def aclose(self) -> None:
        """close(), waiting until the server has let the session go and the connections are closed."""
        self._closed = True
        self._wake.set()
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._shutdown())
        await asyncio.shield(self._closing)

    async def __aenter__(self) -> RemoteSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        return self._closed

    async def _shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        try:
            if self.id:
                r = await self._http.delete(f"/v1/sessions/{self.id}")
                if r.status_code not in (204, 404):
                    log.warning("%s: DELETE session %s answered %d: %s", self.url, self.id, r.status_code, _reason(r))
        except httpx.HTTPError as e:
            log.warning("%s: DELETE session %s failed: %s", self.url, self.id, e)
        finally:
            if self._ws is not None:
                await self._ws.close()
            await self._pc.close()
            await self._http.aclose()

    def _check_socket(self) -> None:
        """SessionRefused, saying the server's reason, once the server has closed the speech socket (the
        session ended, 4410; a refused key, 4401; no such session, 4404; a message it refused, 1003/1007/1009):
        speech pushed after that would go nowhere."""
        if self._refused is not None and not self._closed:
            raise self._refused

    def _socket_closed(self, e) -> None:
        """The speech socket has closed (websockets' ConnectionClosed `e`): by the server with a code, why."""
        close = e.rcvd
        if close is None or close.code == 1000 or self._closed or self._refused is not None:
            return
        code = close.code
        reason = self.error if self.error else close.reason or "no reason given"
        status = code - 4000 if 4000 <= code < 5000 else 422 if code in (1003, 1007, 1009) else None
        self._refused = SessionRefused(status, f"{self.url}: session {self.id}: the server closed its speech "
                                               f"socket ({code}): {reason}")
        log.warning("%s", self._refused)

    def _send(self, message: bytes | str) -> None:
        if threading.get_ident() == self._loop_thread:
            self._outbox.put_nowait(message)
        else:
            self._loop.call_soon_threadsafe(self._outbox.put_nowait, message)

    # --- the connections' readers ----------------------------------------------------------------

    async def _send_speech(self) -> None:
        import websockets

        try:
            while True:
                await self._ws.send(await self._outbox.get())
        except websockets.ConnectionClosed as e:
            self._socket_closed(e)
            self._ended("the speech WebSocket closed")

    async def _read_events(self) -> None:
        import websockets

        try:
            async for message in self._ws:
                m = json.loads(message)
                if m.get("type") == "speech":
                    self._event(SpeechEvent(m["kind"], int(m["utterance"]), int(m["frame"]),
                                            float(m["position_s"]), time.monotonic()))
                elif m.get("type") in ("switched", "switch_refused"):
                    self.cuts.append(m)
                    if m["type"] == "switched":
                        self.avatar = m["avatar"]
                    else:
                        self.error = m.get("message")
                        log.warning("%s: session %s: switch refused: %s", self.url, self.id, self.error)
                elif m.get("type") == "error":
                    self.error = m.get("message")
                    log.warning("%s: session %s: %s", self.url, self.id, self.error)
                elif m.get("type") == "ended":  # the server ended it (a worker process died, say): why
                    self.error = f"the server ended the session: {m.get('reason')}"
                    log.warning("%s: session %s: %s", self.url, self.id, self.error)
        except websockets.ConnectionClosed as e:
            self._socket_closed(e)
        self._ended("the speech WebSocket closed")

    def _event(self, e: SpeechEvent) -> None:
        if e.kind == "started":
            self._spans[e.utterance] = [e.frame, None]
            while len(self._spans) > 64:
                self._spans.pop(next(iter(self._spans)))
        elif e.utterance in self._spans:
            self._spans[e.utterance][1] = e.frame + 1 if e.kind == "finished" else e.frame
        if len(self._events) >= KEEP_EVENTS:
            self._events.popleft()
        self._events.append(e)
        self._wake.set()

    async def _read_video(self, track) -> None:
        from aiortc.mediastreams import MediaStreamError

        try:
            while True:
                frame = await track.recv()
                index = round(frame.pts * self.fps / RTP_VIDEO_CLOCK)
                if self._next is not None and index < self._next:
                    continue  # a frame sent after it played (the server's late packets): it was handed out
                w, h = self.size if self._scale else (frame.width, frame.height)
                if not self._scale:
                    self.size = (w, h)
                if frame.colorspace == 1:  # AVCOL_SPC_BT709 in the stream's VUI
                    self.matrix = "bt709"
                i420 = frame.to_ndarray(format="yuv420p", width=w, height=h)
                i420.flags.writeable = False
                self._pictures[index] = _Picture(i420, time.monotonic())
                while len(self._pictures) > KEEP_PICTURES:
                    self._pictures.pop(min(self._pictures))
                self._wake.set()
        except MediaStreamError:
            self._ended("the video track ended")

    async def _read_audio(self, track) -> None:
        from aiortc.mediastreams import MediaStreamError

        try:
            while True:
                frame = await track.recv()
                samples = frame.to_ndarray()
                channels = len(frame.layout.channels)
                if frame.format.is_planar:
                    mono = samples.astype(np.float32).mean(axis=0)
                else:
                    mono = samples.reshape(-1, channels).astype(np.float32).mean(axis=1)
                if frame.format.name.startswith("s16"):
                    mono /= 32768.0
                start = round(frame.pts * AUDIO_RATE * frame.time_base) if frame.time_base else int(frame.pts)
                self._audio.put(start, mono)
                self._wake.set()
        except MediaStreamError:
            self._ended("the audio track ended")

    def _ended(self, why: str) -> None:
        if not self._closed:
            log.info("%s: session %s: %s", self.url, self.id, why)
        self._tracks_ended += 1
        self._wake.set()

    # --- the consumer's side ---------------------------------------------------------------------

    def __aiter__(self) -> RemoteSession:
        return self

    async def __anext__(self) -> LiveFrame | SpeechEvent:
        while True:
            if self._out:
                return self._out.popleft()
            if self._closed:
                raise StopAsyncIteration
            wait = self._assemble()
            if self._out:
                continue
            if self._tracks_ended and not self._pictures:
                self._release_events(None)
                if not self._out:
                    raise StopAsyncIteration
                continue
            self._wake.clear()
            try:
                await wait_for(self._wake.wait(), wait)
            except (TimeoutError, asyncio.TimeoutError):
                pass

    def _assemble(self) -> float:
        """Hand out the next frame if it can go now; else how long to wait before looking again."""
        if self._next is None:
            if not self._pictures:
                self._release_events(None)
                return 1.0
            self._next = min(self._pictures)
        f = self._next
        if self._pictures and max(self._pictures) - f > self.fps * 2:  # a consumer that stopped reading: skip on
            f = self._next = min(k for k in self._pictures if k >= max(self._pictures) - self.fps)
        a, b = self._clock.samples48(f)
        now = time.monotonic()
        picture = self._pictures.get(f)
        ended = self._tracks_ended > 0
        if picture is not None:
            waited = now - picture.arrived
            if self._audio.end >= b or waited >= AUDIO_WAIT_S or ended:
                self._hand_out(f, self._pictures.pop(f).i420, late=False)
                return 0.0
            return AUDIO_WAIT_S - waited
        newer = [p.arrived for k, p in self._pictures.items() if k > f]
        if self._audio.end >= b + LATE_WAIT_S * AUDIO_RATE or (newer and (self._audio.end >= b or ended
                                                                          or now - min(newer) >= AUDIO_WAIT_S)):
            self._hand_out(f, self._last, late=True)  # the server played it late: no picture was sent
            return 0.0
        return AUDIO_WAIT_S if not newer else max(0.0, AUDIO_WAIT_S - (now - min(newer)))

    @property
    def stats(self) -> SessionStats:
        """What this client saw: frames handed out, and of those late (the server sent no picture in time);
        the server's own counters are at GET /v1/sessions/{id}."""
        return SessionStats(played=self.played, late=self.late, late_speech=self.late_speech)

    def _hand_out(self, f: int, i420: np.ndarray, late: bool) -> None:
        self._release_events(f)
        a, b = self._clock.samples48(f)
        audio = self._audio.take(a, b)
        audio.flags.writeable = False
        utterance = self._utterance_at(f)
        self._out.append(LiveFrame(f, self.fps, i420, audio, utterance, late=late))
        self.played += 1
        self.late += late
        self.late_speech += late and utterance is not None
        self._last, self._next = i420, f + 1
        self._release_events(f, after=True)

    def _utterance_at(self, f: int) -> int | None:
        for u, (first, end) in self._spans.items():
            if first <= f and (end is None or f < end):
                return u
        return None

    def _release_events(self, f: int | None, after: bool = False) -> None:
        """Speech events due before frame f ("started" and "interrupted" at f or earlier, "finished" before
        it), or after it (its "finished"); f None: every event whose frame has been handed out."""
        keep: deque[SpeechEvent] = deque()
        for e in self._events:
            if f is None:
                due = self._next is None or e.frame < self._next
            elif after:
                due = e.kind == "finished" and e.frame <= f
            else:
                due = e.frame < f or (e.frame == f and e.kind != "finished")
            (self._out if due else keep).append(e)
        self._events = keep
