"""Live sessions over WebRTC: a LiveEngine Session's frames out as an audio and a video track.

The client posts an SDP offer (WHEP's shape: offer in, answer out, a Location to DELETE) and
gets the presenter's tracks. Speech comes in over a WebSocket (PCM16 chunks, `end`, `interrupt`;
speech events go back on it) or as the client's own audio track. The session is read here, at its
playout pace, and its media goes to the session's peer connection, which lives in a WebRTC worker
process (serve/rtc.py): aiortc's Python must not hold this process's GIL, which the engine's core
thread needs for every PyTorch op. The session's timestamps become the RTP clocks, so audio and
video leave together at each frame's playout time.

When the offer takes H.264 (browsers and aiortc do), the session's own H.264 goes out as it is:
x264 (zerolatency, constant quality), encoded in the engine's worker processes as each frame is
rendered, before its playout time. Otherwise aiortc encodes VP8 from raw frames in the RTC worker:
on a 2-core CPU 16 ms a 720p frame at its 0.5 Mbit/s start rate, against x264's 4 ms in an encode
worker (docs/BENCHMARKS.md), and at every frame's playout time, so it adds to latency. The audio
is always the session's samples at playout, Opus-encoded by aiortc: a frame rendered late must not
make its sound late (its packets would be), and Opus costs little next to video.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from lipstream.heap import give_back_heap
from lipstream.live import LiveFrame, Session, SpeechEvent
from lipstream.media.rates import AUDIO_RATE
from lipstream.serve.auth import Caller
from lipstream.live.interface import SessionRefused
from lipstream.serve.interface import SessionGone
from lipstream.serve.rtc import VIDEO_CLOCK, PeerHandlers, RemotePeer, RtcGateway

log = logging.getLogger(__name__)
STALE_S = 0.1  # encoded video this far behind its playout time is dropped (and an IDR asked for)


def prefer_h264(offer: str) -> str | None:
    """The offer with H.264 (packetization-mode 1, constrained baseline first) ahead of its other video
    codecs, so the answer and the sender take it; None when its video offers no such H.264. Both the
    m-line and the rtpmap lines are reordered: aiortc reads preference from the rtpmap order."""
    sep = "\r\n" if "\r\n" in offer else "\n"
    lines = offer.split(sep)
    m = next((i for i, line in enumerate(lines) if line.startswith("m=video ")), None)
    if m is None:
        return None
    end = next((i for i in range(m + 1, len(lines)) if lines[i].startswith("m=")), len(lines))
    section = lines[m + 1:end]
    rtpmap = {line.split(":", 1)[1].split()[0]: line for line in section if line.startswith("a=rtpmap:")}
    fmtp = {line.split(":", 1)[1].split()[0]: line.lower() for line in section if line.startswith("a=fmtp:")}
    usable = [pt for pt, line in rtpmap.items()
              if " h264/90000" in line.lower() and "packetization-mode=1" in fmtp.get(pt, "")]
    if not usable:
        return None
    usable.sort(key=lambda pt: ("profile-level-id=42e0" not in fmtp[pt], int(pt)))
    head = lines[m].split()
    lines[m] = " ".join(head[:3] + usable + [pt for pt in head[3:] if pt not in usable])
    first = next(i for i, line in enumerate(section) if line.startswith("a=rtpmap:"))
    moved = {rtpmap[pt] for pt in usable}
    rest = [line for line in section if line not in moved]
    section = rest[:first] + [rtpmap[pt] for pt in usable] + rest[first:]
    return sep.join(lines[:m + 1] + section + lines[end:])


@dataclass
class LiveSession:
    """One client's presenter: the engine's session, its peer connection (in a worker), its events."""

    id: str
    owner: str
    avatar: str
    session: Session
    peer: RemotePeer | None = None
    events: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(256))
    tasks: list[asyncio.Task] = field(default_factory=list)
    encoded: bool = False  # the session's own H.264 packets go out (else raw frames, aiortc encodes VP8)
    observe_latency: Callable[[float], None] = lambda seconds: None  # audio pushed -> frame ready
    failed: Callable[[str], None] = lambda why: None  # the session cannot go on (the server closes it)
    ended: str | None = None  # why the server ended it (a worker died...); None: its client closed it

    async def pump(self) -> None:
        """Read the session at its playout pace: media to the peer, speech events to the socket."""
        fps = self.session.fps
        peer = self.peer
        try:
            async for item in self.session:
                if isinstance(item, LiveFrame):
                    if item.latency_s is not None:
                        self.observe_latency(item.latency_s)
                    if self.encoded:
                        lost = self.session.handoff.encoder_lost
                        if lost is not None:  # its video can never go out again: the session ends, said why
                            self.failed(f"its video encoder stopped: {lost}")
                            return
                        self._put_packets(item)
                    else:
                        peer.frame(item.i420, int(item.frame * VIDEO_CLOCK / fps))
                    start = (item.frame * AUDIO_RATE * fps.denominator) // fps.numerator
                    peer.audio((np.clip(item.audio, -1, 1) * 32767).astype(np.int16), start)
                    await peer.drain()
                elif isinstance(item, SpeechEvent):
                    if self.events.full():
                        self.events.get_nowait()
                    self.events.put_nowait({"type": "speech", "kind": item.kind, "utterance": item.utterance,
                                            "frame": item.frame, "position_s": round(item.position_s, 3),
                                            "pts": item.frame})  # "pts": the old name, for one release
        finally:
            peer.end()

    def _put_packets(self, item: LiveFrame) -> None:
        """The frame's H.264 access unit (with those of frames rendered after they played), as aiortc sends
        pre-encoded media. One more than STALE_S behind its playout is dropped, with what depends on it,
        until an IDR asked for now: the viewer keeps the last picture, as a late frame shows it, and
        the next IDR (however late) shows a new one."""
        for p in item.packets:
            if p.kind != "video":
                continue
            if not p.keyframe and item.time_s - p.time_s > STALE_S:
                self.peer.gap()
                continue
            # an IDR goes out however late: a picture the viewer can decode, it ends the freeze (dropped, a
            # late IDR asked for by a gap would freeze the picture until the next one on time)
            self.peer.video(p.data, p.pts, p.dts, p.time_base, p.keyframe)


class LocalSpeech:
    """A session of this process as the speech socket drives it (serve/interface.py's SpeechLink)."""

    def __init__(self, sessions: LiveSessions, live: LiveSession):
        self.sessions, self.live = sessions, live

    def _session(self) -> Session:
        if self.sessions.open.get(self.live.id) is not self.live:
            raise SessionGone(f"session {self.live.id} has ended")
        return self.live.session

    async def push(self, pcm16: bytes, rate: int) -> None:
        pcm = np.frombuffer(pcm16, "<i2")
        session = self._session()
        if pcm.size:
            session.push_audio(pcm, rate)

    async def command(self, kind: str) -> None:
        session = self._session()
        if kind == "end":
            session.end_utterance()
        elif kind == "interrupt":
            session.clear()

    async def switch(self, avatar: str) -> None:
        """A camera cut; its answer goes out with the speech events, in order with them."""
        session = self._session()
        live = self.live
        try:
            if avatar not in self.sessions.s.avatars:
                raise ValueError(f"avatar: {avatar!r} is not resident on this server")
            frame = session.switch(self.sessions.s.avatars[avatar])
        except ValueError as e:
            answer = {"type": "switch_refused", "avatar": avatar, "message": str(e)}
        else:
            live.avatar = avatar
            answer = {"type": "switched", "avatar": avatar, "frame": frame}
        if live.events.full():
            live.events.get_nowait()
        live.events.put_nowait(answer)

    async def events(self):
        """Speech events until the session ends; then, if the server ended it, an 'ended' event with why."""
        while (event := await self.live.events.get()) is not None:
            yield event


class LiveSessions:
    """The server's live sessions, by id, and the WebRTC workers their peer connections live in: the
    SessionHost (serve/interface.py) of one process, or of one engine replica of a fleet, whose session
    ids begin with `id_prefix` (the replica's name: the fleet's front reaches a session through it)."""

    def __init__(self, service, rtc_workers: int, id_prefix: str = ""):
        self.s = service
        self.open: dict[str, LiveSession] = {}
        self.gateway = RtcGateway(rtc_workers)
        self.id_prefix = id_prefix

    async def start_workers(self) -> None:
        await self.gateway.start()

    def count(self, owner: str) -> int:
        return sum(x.owner == owner for x in self.open.values())

    async def start(self, owner: str, avatar: str, offer_sdp: str, playout_delay_s: float | None = None,
                    fps: Fraction | None = None, latency: str | None = None) -> tuple[LiveSession, str]:
        """Open an engine session (SessionRefused when full) and answer the client's offer (ValueError:
        a bad offer; RuntimeError: no WebRTC worker could take it)."""
        h264_offer = prefer_h264(offer_sdp)
        encoded = h264_offer is not None
        session = self.s.live.open_session(self.s.avatars[avatar], fps=fps, encode=encoded,
                                           playout_delay_s=playout_delay_s, latency=latency)
        live = LiveSession(self.id_prefix + secrets.token_hex(8), owner, avatar, session, encoded=encoded,
                           observe_latency=self.s.metrics.frame_latency.observe)
        self.open[live.id] = live
        live.failed = functools.partial(self._failed, live.id)  # not a closure over `live`: no cycle through it
        handlers = PeerHandlers(keyframe=session.request_keyframe, mic=session.push_audio, failed=live.failed)
        try:
            worker = await self.gateway.pick()
            live.peer, answer = await worker.open_peer(live.id, h264_offer or offer_sdp, encoded,
                                                       session.clock.deadline(0), handlers)
            live.tasks.append(asyncio.ensure_future(live.pump()))
        except BaseException:
            await self.close(live.id)
            raise
        return live, answer

    def _failed(self, sid: str, why: str) -> None:
        """The session cannot go on (its WebRTC worker or its encoder died, its connection failed): closed,
        and its speech socket told why."""
        live = self.open.get(sid)
        if live is not None and live.ended is None:
            live.ended = why
            log.warning('{"event": "session_failed", "id": "%s", "why": "%s"}', sid, why.replace('"', "'"))
            asyncio.ensure_future(self.close(sid))

    async def close(self, sid: str) -> bool:
        live = self.open.pop(sid, None)
        if live is None:
            return False
        # its speech socket's events end (the socket closes), after why if the server ended it
        for last in ([{"type": "ended", "reason": live.ended}] if live.ended is not None else []) + [None]:
            if live.events.full():
                live.events.get_nowait()
            live.events.put_nowait(last)
        self.s.closed_late += live.session.stats.late
        self.s.live.close_session(live.session)
        for task in live.tasks:
            task.cancel()
        live.tasks.clear()  # a cancelled task's traceback holds its frames, and so `live`: no cycle back to it
        if live.peer is not None:
            await live.peer.close()
        log.info('{"event": "session_closed", "id": "%s", "frames_late": %d}', sid, live.session.stats.late)
        asyncio.get_running_loop().run_in_executor(None, give_back_heap)
        return True

    # the SessionHost interface (serve/interface.py), what the routes use

    async def open_for(self, owner: str, avatar: str, offer: str, playout_delay_s: float | None,
                       fps: Fraction | None, latency: str | None = None) -> tuple[str, str]:
        try:
            live, answer = await self.start(owner, avatar, offer, playout_delay_s, fps, latency)
        except SessionRefused:  # the engine is full
            raise
        except ValueError as e:  # the WebRTC stack's own words (such as "None is not in list") stay in the log
            log.info(json.dumps({"event": "offer_refused", "error": str(e).splitlines()[0][:200]}))
            raise SessionRefused(422, "offer: not a valid SDP offer (WebRTC could not answer it)") from None
        except RuntimeError as e:  # its WebRTC worker died under it: a new one takes the next session
            raise SessionRefused(503, str(e)) from None
        return live.id, answer

    async def owned(self, owner: str) -> int:
        return self.count(owner)

    def _own(self, sid: str, who: Caller) -> LiveSession | None:
        live = self.open.get(sid)
        return live if live is not None and who.sees(live.owner) else None

    async def listing(self, who: Caller) -> list[dict]:
        return [{"id": x.id, "avatar": x.avatar, "frames_played": x.session.stats.played,
                 "frames_late": x.session.stats.late} for x in list(self.open.values()) if who.sees(x.owner)]

    async def status(self, sid: str, who: Caller) -> dict | None:
        live = self._own(sid, who)
        if live is None:
            return None
        s = live.session
        return {"id": live.id, "avatar": live.avatar, "playout_delay_ms": round(s.o.playout_delay_s * 1000, 1),
                "window_ahead_ms": s.o.window_ahead_steps * 20,
                "video": "h264" if live.encoded else "vp8", "stats": dataclasses.asdict(s.stats),
                "timings_ms": s.timings_ms()}

    async def close_for(self, sid: str, who: Caller) -> bool:
        return self._own(sid, who) is not None and await self.close(sid)

    async def speech(self, sid: str, who: Caller) -> LocalSpeech | None:
        live = self._own(sid, who)
        return None if live is None else LocalSpeech(self, live)

    async def close_all(self) -> None:
        for sid in list(self.open):
            await self.close(sid)
        await self.gateway.close()
