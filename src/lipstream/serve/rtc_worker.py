"""A WebRTC worker process: aiortc's peer connections for some of `lipstream serve`'s live sessions.

aiortc runs every session's RTP, SRTP, ICE and Opus in Python. In the server's own process that work
held the GIL most of the time, and each PyTorch op of the engine's core thread waited for it (on the
H200 at 23 sessions a 3 ms streaming-Whisper call took ~270 ms, traced or not; docs/BENCHMARKS.md).
Here it has a process of its own, and the server sends it what each session plays, at playout.

`python -m lipstream.serve.rtc_worker` reads messages on stdin and answers on stdout, framed as the
encode workers' are (lipstream.media.wire: struct '<I' length, JSON header line, payload); serve/rtc.py
is the server's side. Imports only the stdlib, numpy, PyAV, aiortc and lipstream.media: no torch.

  server -> worker                                             worker -> server
  open {sid, sdp, encoded, audio_zero}                         answer {sid, sdp} | error {sid, message}
  video {sid, pts, dts, tb: [n, d], key} + H.264 access unit
  frame {sid, pts, width, height} + I420 picture (aiortc encodes VP8)
  audio {sid, at} + PCM16 mono 48 kHz from sample `at`
  gap {sid}: video was dropped; nothing until an IDR           keyframe {sid}: the viewer needs an IDR
  end {sid}: the session's media ended                         state {sid, state, why}: the peer is gone
  close {sid}                                                  closed {sid}
  ping {}                                                      pong {pid, torch: whether torch is imported}
                                                               mic {sid, rate} + float32 mono: the client's track

A peer gives its session back: one that has not connected PEER_CONNECT_S after its answer (no ICE, no
DTLS), one whose connection fails, and one that goes silent (it stops answering ICE's consent checks, RFC 7675:
a client killed, a network gone) are each reported to the server, which closes the session.

`audio_zero` is the time.monotonic() at which audio sample 0 plays (one clock for every process of the
host): each 20 ms of audio is held back until its time, so Opus packets go out 20 ms apart. EOF on
stdin ends the worker.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import math
import os
import signal
import sys
import time
import weakref
from fractions import Fraction
from pathlib import Path

import aioice.ice
import av
import numpy as np
from aiortc import MediaStreamTrack, RTCPeerConnection, RTCSessionDescription, rtp
from aiortc.mediastreams import MediaStreamError

from lipstream.heap import give_back_heap
from lipstream.media.wire import frame_parts, one_line, read_message_async
from lipstream.media.rates import AUDIO_RATE
from lipstream.serve.rtc import VIDEO_CLOCK

QUEUE_FRAMES = 100  # a track's backlog (4 s of video at 25 fps, 2 s of audio) before its oldest frames go
OPUS_FRAME = 960  # 20 ms at 48 kHz
PEER_CONNECT_S = 10.0  # a peer not connected this long after its answer gives its session back
CONSENT_INTERVAL_S, CONSENT_FAILURES = 2, 3  # ICE consent checks: a peer that leaves three unanswered in a row
# (one try each) is gone, 6-9 s after it went silent; aioice's own 5 s x 6 held a dead session for half a minute
WHY = {"failed": "the connection failed (ICE or DTLS)",
       "closed": "the connection closed (the client left)",
       "silent": "the connection closed (the client stopped answering ICE's consent checks)"}


class ConsentExpiries(logging.Handler):
    """aioice's ICE connections whose consent expired (it says so only in its log, then closes them): a peer
    whose connection closes after one did went silent; one that closes otherwise was closed by its client."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.expired: weakref.WeakSet = weakref.WeakSet()

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).endswith("Consent to send expired") and record.args:
            self.expired.add(record.args[0])

    def install(self) -> ConsentExpiries:
        ice_log = logging.getLogger("aioice.ice")
        ice_log.addHandler(self)
        if not ice_log.isEnabledFor(logging.INFO):
            ice_log.setLevel(logging.INFO)
            ice_log.propagate = False  # its INFO lines are for this handler, not the server's stderr
        return self


CONSENT = ConsentExpiries()


def audio_level_dbov(frame: av.AudioFrame) -> int:
    """RFC 6465's audio level of a frame exactly as aiortc's rtp.compute_audio_level_dbov has it, in numpy:
    aiortc's own sums the samples in a Python loop, 60 us a 20 ms packet (3 us here)."""
    samples = np.frombuffer(bytes(frame.planes[0]), np.int16).astype(np.float64)
    rms = math.sqrt(float(samples @ samples) / (frame.samples * 32767 * 32767))
    return round(min(max(20 * math.log10(rms), -127), 0)) if rms > 0 else -127


rtp.compute_audio_level_dbov = audio_level_dbov  # aiortc's sender calls it through the module


def ffmpeg_one_thread() -> bool:
    """FFmpeg's automatic thread count as 1 in this process (av_cpu_force_count); False where it is not found.

    aiortc's Opus encoder resamples through FFmpeg filter graphs whose thread pools FFmpeg sizes by the
    host's cores when nothing else is said: on a 16-core host 15 idle threads a session, and with PyAV 19
    they stayed until the cyclic garbage collector freed the closed peer connection holding them (rtc
    workers' threads 158 -> 458 in 4 minutes of sessions opening and closing). 20 ms Opus frames need no
    threads. Codecs given a thread count (aiortc's VP8 encoder) keep it."""
    try:
        maps = Path("/proc/self/maps").read_text().split()
    except OSError:  # not Linux: FFmpeg's own count stays
        return False
    for path in dict.fromkeys(w for w in maps if "/libavutil" in w):
        try:
            ctypes.CDLL(path).av_cpu_force_count(1)  # the copy PyAV loaded (dlopen hands back its handle)
        except (OSError, AttributeError):
            continue
        return True
    return False


class PacedTrack(MediaStreamTrack):
    """Frames (or encoded packets) as the server sent them; `due(frame)` (time.monotonic()) holds each back
    until its playout time. A reader that falls behind loses the oldest; for encoded video that breaks the
    decoder's reference chain, so the track drops up to the next IDR and asks for one (`on_gap`)."""

    def __init__(self, kind: str, due=None):
        super().__init__()
        self.kind = kind
        self.queue: asyncio.Queue = asyncio.Queue(QUEUE_FRAMES)
        self.due = due
        self.on_gap = None
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


class PeerConnection:
    """One session's aiortc peer connection and its two paced tracks."""

    def __init__(self, worker: RtcWorker, sid: str, encoded: bool, audio_zero: float):
        self.worker, self.sid = worker, sid
        self.pc = RTCPeerConnection()
        self.video = PacedTrack("video")
        self.audio = PacedTrack("audio", due=lambda frame: audio_zero + frame.pts / AUDIO_RATE)
        if encoded:
            self.video.on_gap = self.ask_keyframe
        self.pcm, self.pcm_at = np.zeros(0, np.int16), 0  # audio not sent yet, and the sample it starts at
        self.tasks: list[asyncio.Task] = []
        self._gone = False

    def ask_keyframe(self) -> None:
        self.worker.reply({"type": "keyframe", "sid": self.sid})

    async def answer(self, sdp: str, encoded: bool) -> str:
        pc = self.pc

        @pc.on("track")
        def on_track(track: MediaStreamTrack) -> None:
            if track.kind == "audio":
                self.tasks.append(asyncio.ensure_future(self.listen(track)))

        @pc.on("connectionstatechange")
        async def on_state() -> None:
            if pc.connectionState in ("failed", "closed"):
                silent = any(getattr(t.sender.transport.transport, "_connection", None) in CONSENT.expired
                             for t in pc.getTransceivers() if t.sender.transport is not None)
                self.gone(pc.connectionState, WHY["silent" if silent else pc.connectionState])

        await pc.setRemoteDescription(RTCSessionDescription(sdp, "offer"))
        video = pc.addTrack(self.video)  # after the offer: the tracks take its m-lines, in its order
        pc.addTrack(self.audio)
        if encoded:  # a viewer that lost packets asks for a picture it can decode: the next frame an IDR
            keyframe = video._send_keyframe
            video._send_keyframe = lambda: (self.ask_keyframe(), keyframe())
        await pc.setLocalDescription(await pc.createAnswer())  # aiortc gathers its candidates here
        self.tasks.append(asyncio.ensure_future(self.connect_or_give_back()))
        return pc.localDescription.sdp

    async def connect_or_give_back(self) -> None:
        await asyncio.sleep(PEER_CONNECT_S)
        if self.pc.connectionState != "connected":
            self.gone("failed", f"the client did not connect within {PEER_CONNECT_S:g} s")

    def gone(self, state: str, why: str) -> None:
        """Told to the server once; it closes the session (and then this peer)."""
        if not self._gone:
            self._gone = True
            self.worker.reply({"type": "state", "sid": self.sid, "state": state, "why": why})

    def put_audio(self, at: int, pcm: np.ndarray) -> None:
        """aiortc sends one Opus packet a frame it is given: 20 ms frames, from the session's clock."""
        if at != self.pcm_at + self.pcm.size:  # frames were dropped unread: the audio clock jumps too
            self.pcm, self.pcm_at = np.zeros(0, np.int16), at
        self.pcm = np.concatenate([self.pcm, pcm])
        while self.pcm.size >= OPUS_FRAME:
            audio = av.AudioFrame.from_ndarray(self.pcm[None, :OPUS_FRAME], format="s16", layout="mono")
            audio.sample_rate, audio.pts, audio.time_base = AUDIO_RATE, self.pcm_at, Fraction(1, AUDIO_RATE)
            self.audio.put(audio)
            self.pcm, self.pcm_at = self.pcm[OPUS_FRAME:], self.pcm_at + OPUS_FRAME

    async def listen(self, track: MediaStreamTrack) -> None:
        """The client's own microphone track: its samples, mono float32, to the server."""
        try:
            while True:
                frame = await track.recv()
                samples = frame.to_ndarray().astype(np.float32)
                channels = len(frame.layout.channels)
                mono = samples.mean(axis=0) if frame.format.is_planar else samples.reshape(-1, channels).mean(axis=1)
                if frame.format.name.startswith("s16"):
                    mono /= 32768.0
                self.worker.reply({"type": "mic", "sid": self.sid, "rate": frame.sample_rate},
                                  mono.astype(np.float32).tobytes())
        except MediaStreamError:
            pass

    def end(self) -> None:
        self.video.put(None)
        self.audio.put(None)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await self.pc.close()


class RtcWorker:
    """The peer connections of one WebRTC worker process, and the handling of each message."""

    def __init__(self, out: asyncio.WriteTransport):
        self.out = out
        self.peers: dict[str, PeerConnection] = {}
        self.opening: dict[str, asyncio.Task] = {}

    def reply(self, header: dict, payload: bytes = b"") -> None:
        self.out.writelines(frame_parts(header, payload))

    def handle(self, h: dict, payload: memoryview) -> None:
        kind, sid = h.get("type"), h.get("sid", "")
        peer = self.peers.get(sid)
        if kind == "video":
            if peer is not None:
                packet = av.Packet(bytes(payload))
                packet.pts, packet.dts, packet.time_base = h["pts"], h["dts"], Fraction(*h["tb"])
                peer.video.put(packet, h["key"])
        elif kind == "audio":
            if peer is not None:
                peer.put_audio(h["at"], np.frombuffer(payload, "<i2"))
        elif kind == "frame":
            if peer is not None:
                picture = np.frombuffer(payload, np.uint8).reshape(h["height"] * 3 // 2, h["width"])
                video = av.VideoFrame.from_ndarray(picture, format="yuv420p")
                video.pts, video.time_base = h["pts"], Fraction(1, VIDEO_CLOCK)
                peer.video.put(video)
        elif kind == "gap":
            if peer is not None:
                peer.video.gap()
        elif kind == "end":
            if peer is not None:
                peer.end()
        elif kind == "open":
            self.opening[sid] = asyncio.ensure_future(self.open(sid, h))
        elif kind == "close":
            asyncio.ensure_future(self.close(sid))
        elif kind == "ping":
            self.reply({"type": "pong", "sid": sid, "pid": os.getpid(), "torch": "torch" in sys.modules})
        else:
            self.reply({"type": "error", "sid": sid, "message": f"unknown message {kind!r}"})

    async def open(self, sid: str, h: dict) -> None:
        peer = self.peers[sid] = PeerConnection(self, sid, h["encoded"], h["audio_zero"])
        try:
            sdp = await peer.answer(h["sdp"], h["encoded"])
        except Exception as e:  # a bad offer: the server answers 422 with this
            self.peers.pop(sid, None)
            await peer.close()
            self.reply({"type": "error", "sid": sid, "message": one_line(e)})
        else:
            self.reply({"type": "answer", "sid": sid, "sdp": sdp})
        finally:
            self.opening.pop(sid, None)

    async def close(self, sid: str) -> None:
        opening = self.opening.get(sid)
        if opening is not None:
            await asyncio.wait([opening])
        peer = self.peers.pop(sid, None)
        if peer is not None:
            peer.end()
            await peer.close()
        self.reply({"type": "closed", "sid": sid})
        give_back_heap()  # a closed session's packets and buffers, freed into glibc's arenas (about a millisecond)

    async def close_all(self) -> None:
        for sid in list(self.peers):
            await self.close(sid)


async def serve(stdin, stdout) -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), stdin)
    out, _ = await loop.connect_write_pipe(asyncio.Protocol, stdout)
    worker = RtcWorker(out)
    try:
        while True:
            try:
                message = await read_message_async(reader)
            except EOFError:
                break  # the server is gone mid-message
            except ValueError as e:  # a header that is not JSON (its whole message was read): said, go on
                worker.reply({"type": "error", "sid": "", "message": one_line(e)})
                continue
            if message is None:
                break  # the server closed our stdin
            try:
                worker.handle(*message)
            except Exception as e:  # one bad message: said, and the others go on
                worker.reply({"type": "error", "sid": "", "message": one_line(e)})
    finally:
        await worker.close_all()
        out.close()


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server ends us (EOF), not the terminal's Ctrl-C
    stdin, stdout = sys.stdin.buffer, os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    sys.stdout = sys.stderr  # nothing else may write into the replies
    ffmpeg_one_thread()
    aioice.ice.CONSENT_INTERVAL, aioice.ice.CONSENT_FAILURES = CONSENT_INTERVAL_S, CONSENT_FAILURES  # read per check
    CONSENT.install()
    asyncio.run(serve(stdin, stdout))


if __name__ == "__main__":
    main()
