"""Live sessions over WebRTC: a LiveEngine Session's frames out as an audio and a video track (aiortc).

The client posts an SDP offer (WHEP's shape: offer in, answer out, a Location to DELETE) and
gets the presenter's tracks. Speech comes in over a WebSocket (PCM16 chunks, `end`, `interrupt`;
speech events go back on it) or as the client's own audio track. The session is read once and
fanned out to the two tracks: a track nobody reads loses its oldest frames, never stalls the
session. The session's timestamps become the RTP clocks, so audio and video leave together at each
frame's playout time.

When the offer takes H.264 (browsers and aiortc do), the session's own H.264 goes out as it is:
x264 (zerolatency, constant quality), encoded in the engine's worker processes as each frame is
rendered, before its playout time. Otherwise aiortc encodes VP8 from raw frames on this process's
threads: on a 2-core CPU 16 ms a 720p frame at its 0.5 Mbit/s start rate, against x264's 4 ms in
a worker (docs/BENCHMARKS.md), and at every frame's playout time, so it adds to latency. The audio
is always the session's samples at playout, Opus-encoded by aiortc: a frame rendered late must not
make its sound late (its packets would be), and Opus costs little next to video.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np
from aiortc import MediaStreamTrack, RTCPeerConnection, RTCSessionDescription, rtp
from aiortc.mediastreams import MediaStreamError

from lipstream.live import LiveFrame, Session, SpeechEvent
from lipstream.media.mp4 import AUDIO_RATE

log = logging.getLogger(__name__)
VIDEO_CLOCK = 90_000
QUEUE_FRAMES = 100  # a track's backlog (4 s of video at 25 fps, 2 s of audio) before its oldest frames go
OPUS_FRAME = 960  # 20 ms at 48 kHz
STALE_S = 0.1  # encoded video this far behind its playout time is dropped (and an IDR asked for)


def audio_level_dbov(frame: av.AudioFrame) -> int:
    """RFC 6465's audio level of a frame exactly as aiortc's rtp.compute_audio_level_dbov has it, in numpy:
    aiortc's own sums the samples in a Python loop, 60 us a 20 ms packet on the event loop that
    sends every session's media (3 us here)."""
    samples = np.frombuffer(bytes(frame.planes[0]), np.int16).astype(np.float64)
    rms = math.sqrt(float(samples @ samples) / (frame.samples * 32767 * 32767))
    return round(min(max(20 * math.log10(rms), -127), 0)) if rms > 0 else -127


rtp.compute_audio_level_dbov = audio_level_dbov  # aiortc's sender calls it through the module


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


class _Track(MediaStreamTrack):
    """Frames (or encoded packets) handed over by the session's reader; `due(frame)` (time.monotonic())
    holds each back until its playout time (the audio: a frame's 20 ms pieces go out 20 ms apart, not
    in a burst). A reader that falls behind loses the oldest; for encoded video that breaks the
    decoder's reference chain, so the track drops up to the next IDR and asks for one (`on_gap`)."""

    def __init__(self, kind: str, due: Callable[[av.frame.Frame], float] | None = None):
        super().__init__()
        self.kind = kind
        self.queue: asyncio.Queue = asyncio.Queue(QUEUE_FRAMES)
        self.due = due
        self.on_gap: Callable[[], None] | None = None
        self._waiting_key = False

    def gap(self) -> None:
        """Encoded video lost a frame: nothing until the next IDR, which is asked for."""
        if not self._waiting_key and self.on_gap is not None:
            self._waiting_key = True
            self.on_gap()

    def put(self, frame, key: bool = True) -> None:
        if self.queue.full():  # the reader is behind: drop, do not stall the session
            if self.on_gap is None:
                self.queue.get_nowait()
            else:
                while not self.queue.empty():
                    self.queue.get_nowait()
                self.gap()
        if self._waiting_key:
            if not key:
                return
            self._waiting_key = False
        self.queue.put_nowait(frame)

    async def recv(self):
        frame = await self.queue.get()
        if frame is None:
            self.stop()
            raise MediaStreamError
        if self.due is not None:
            wait = self.due(frame) - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
        return frame


@dataclass
class LiveSession:
    """One client's presenter: the engine's session, its peer connection, its speech socket's events."""

    id: str
    owner: str
    avatar: str
    session: Session
    pc: RTCPeerConnection
    events: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(256))
    video: _Track = field(default_factory=lambda: _Track("video"))
    audio: _Track = field(default_factory=lambda: _Track("audio"))
    tasks: list[asyncio.Task] = field(default_factory=list)
    encoded: bool = False  # the session's own H.264 packets go out (else raw frames, aiortc encodes VP8)
    observe_latency: Callable[[float], None] = lambda seconds: None  # audio pushed -> frame ready

    def __post_init__(self) -> None:
        s = self.session
        self.audio.due = lambda frame: s.t0 + s.o.playout_delay_s + frame.pts / AUDIO_RATE
        if self.encoded:
            self.video.on_gap = s.request_keyframe

    async def pump(self) -> None:
        """Read the session at its playout pace: frames to the tracks, speech events to the socket."""
        fps = self.session.fps
        pcm, pcm_at = np.zeros(0, np.int16), 0  # audio not sent yet, and the sample it starts at
        try:
            async for item in self.session:
                if isinstance(item, LiveFrame):
                    if item.latency_s is not None:
                        self.observe_latency(item.latency_s)
                    if self.encoded:
                        self._put_packets(item)
                    else:
                        video = av.VideoFrame.from_ndarray(item.i420, format="yuv420p")
                        video.pts = int(item.pts * VIDEO_CLOCK / fps)
                        video.time_base = Fraction(1, VIDEO_CLOCK)
                        self.video.put(video)
                    # aiortc sends one Opus packet a frame it is given: 20 ms frames, from the session's clock
                    start = (item.pts * AUDIO_RATE * fps.denominator) // fps.numerator
                    if start != pcm_at + pcm.size:  # frames were dropped unread: the audio clock jumps too
                        pcm, pcm_at = np.zeros(0, np.int16), start
                    pcm = np.concatenate([pcm, (np.clip(item.audio, -1, 1) * 32767).astype(np.int16)])
                    while pcm.size >= OPUS_FRAME:
                        audio = av.AudioFrame.from_ndarray(pcm[None, :OPUS_FRAME], format="s16", layout="mono")
                        audio.sample_rate, audio.pts, audio.time_base = AUDIO_RATE, pcm_at, Fraction(1, AUDIO_RATE)
                        self.audio.put(audio)
                        pcm, pcm_at = pcm[OPUS_FRAME:], pcm_at + OPUS_FRAME
                elif isinstance(item, SpeechEvent):
                    if self.events.full():
                        self.events.get_nowait()
                    self.events.put_nowait({"type": "speech", "kind": item.kind, "utterance": item.utterance,
                                            "pts": item.pts, "position_s": round(item.position_s, 3)})
        finally:
            self.video.put(None)
            self.audio.put(None)

    def _put_packets(self, item: LiveFrame) -> None:
        """The frame's H.264 access unit (with those of frames rendered after they played), as aiortc sends
        pre-encoded media. One more than STALE_S behind its playout is dropped, with what depends on it,
        until an IDR asked for now: the viewer keeps the last picture, as a late frame shows it, and
        the next IDR (however late) shows a new one."""
        for p in item.packets:
            if p.kind != "video":
                continue
            if not p.keyframe and item.time_s - p.time_s > STALE_S:
                self.video.gap()
                continue
            # an IDR goes out however late: a picture the viewer can decode, it ends the freeze (dropped, a
            # late IDR asked for by a gap would freeze the picture until the next one on time)
            packet = av.Packet(p.data)
            packet.pts, packet.dts, packet.time_base = p.pts, p.dts, p.time_base
            self.video.put(packet, p.keyframe)

    async def listen(self, track: MediaStreamTrack) -> None:
        """The client's own microphone track: its samples are the session's speech."""
        try:
            while True:
                frame = await track.recv()
                samples = frame.to_ndarray().astype(np.float32)
                channels = len(frame.layout.channels)
                mono = samples.mean(axis=0) if frame.format.is_planar else samples.reshape(-1, channels).mean(axis=1)
                if frame.format.name.startswith("s16"):
                    mono /= 32768.0
                self.session.push_audio(mono, frame.sample_rate)
        except MediaStreamError:
            pass


class LiveSessions:
    """The server's live sessions, by id."""

    def __init__(self, service):
        self.s = service
        self.open: dict[str, LiveSession] = {}

    def count(self, owner: str) -> int:
        return sum(x.owner == owner for x in self.open.values())

    async def start(self, owner: str, avatar: str, offer_sdp: str,
                    playout_delay_s: float | None = None) -> tuple[LiveSession, str]:
        """Open an engine session (AdmissionError when full) and answer the client's offer."""
        h264_offer = prefer_h264(offer_sdp)
        encoded = h264_offer is not None
        session = self.s.live.open_session(self.s.avatars[avatar], encode=encoded,
                                           playout_delay_s=playout_delay_s)
        pc = RTCPeerConnection()
        live = LiveSession(secrets.token_hex(8), owner, avatar, session, pc, encoded=encoded,
                           observe_latency=self.s.metrics.frame_latency.observe)
        self.open[live.id] = live
        try:
            @pc.on("track")
            def on_track(track: MediaStreamTrack) -> None:
                if track.kind == "audio":
                    live.tasks.append(asyncio.ensure_future(live.listen(track)))

            @pc.on("connectionstatechange")
            async def on_state() -> None:
                if pc.connectionState in ("failed", "closed"):
                    await self.close(live.id)

            await pc.setRemoteDescription(RTCSessionDescription(h264_offer or offer_sdp, "offer"))
            video = pc.addTrack(live.video)  # after the offer: the tracks take its m-lines, in its order
            pc.addTrack(live.audio)
            if encoded:  # a viewer that lost packets asks for a picture it can decode: the next frame an IDR
                keyframe = video._send_keyframe
                video._send_keyframe = lambda: (session.request_keyframe(), keyframe())
            await pc.setLocalDescription(await pc.createAnswer())  # aiortc gathers its candidates here
            live.tasks.append(asyncio.ensure_future(live.pump()))
        except BaseException:
            await self.close(live.id)
            raise
        return live, pc.localDescription.sdp

    async def close(self, sid: str) -> bool:
        live = self.open.pop(sid, None)
        if live is None:
            return False
        self.s.closed_late += live.session.stats.late
        self.s.live.close_session(live.session)
        for task in live.tasks:
            task.cancel()
        await live.pc.close()
        log.info('{"event": "session_closed", "id": "%s", "frames_late": %d}', sid, live.session.stats.late)
        return True

    async def close_all(self) -> None:
        for sid in list(self.open):
            await self.close(sid)
