"""The server's WebRTC workers: aiortc in processes of their own, off the engine's GIL.

Each live session's peer connection lives in one worker (lipstream.serve.rtc_worker lists the messages,
lipstream.media.wire frames them); the server sends it the session's media as the session plays it and
gets back the answer, keyframe requests, the connection's failure and the client's own microphone samples.
Sessions go to the worker with the fewest; a worker that dies fails its sessions (the server closes
them) and a new one is started for the next session.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from lipstream.aio import wait_for
from lipstream.media.processes import AsyncWorker, start_worker_async
from lipstream.media.wire import frame_parts, read_message_async

log = logging.getLogger(__name__)
REPLY_TIMEOUT_S = 30.0  # an answer (ICE gathering included) or a close
VIDEO_CLOCK = 90_000  # RTP's video clock: raw pictures' pts go to the worker in it


def default_workers() -> int:
    """A worker per 4 cores, 1 to 8: at 23 sessions aiortc kept about one core busy on the H200."""
    return max(1, min(8, (os.cpu_count() or 2) // 4))


@dataclass
class PeerHandlers:
    """What the server does when a worker speaks for one session."""

    keyframe: Callable[[], None]
    failed: Callable[[str], None]  # the connection failed or closed, or the worker died (the reason)
    mic: Callable[[np.ndarray, int], None]  # the client's own audio track: float32 mono, its rate


class RemotePeer:
    """The server's handle of one session's peer connection, which lives in a worker: its media goes there."""

    def __init__(self, worker: RtcWorkerProcess, sid: str, handlers: PeerHandlers):
        self.worker, self.sid, self.handlers = worker, sid, handlers

    def video(self, data: bytes, pts: int, dts: int, time_base: Fraction, key: bool) -> None:
        self.worker.send({"type": "video", "sid": self.sid, "pts": pts, "dts": dts,
                          "tb": [time_base.numerator, time_base.denominator], "key": key}, data)

    def frame(self, i420: np.ndarray, pts: int) -> None:
        """A raw picture (H/2*3 x W, I420) for aiortc to encode; pts in 1/90000 s."""
        self.worker.send({"type": "frame", "sid": self.sid, "pts": pts, "width": i420.shape[1],
                          "height": i420.shape[0] * 2 // 3}, np.ascontiguousarray(i420).data)

    def audio(self, pcm16: np.ndarray, at: int) -> None:
        self.worker.send({"type": "audio", "sid": self.sid, "at": at}, np.ascontiguousarray(pcm16, "<i2").data)

    def gap(self) -> None:
        self.worker.send({"type": "gap", "sid": self.sid})

    def end(self) -> None:
        self.worker.send({"type": "end", "sid": self.sid})

    async def drain(self) -> None:
        await self.worker.drain()

    async def close(self) -> None:
        await self.worker.close_peer(self.sid)


class RtcWorkerProcess:
    """The server's handle of one WebRTC worker process: its pipes, its reader task and the sessions it holds."""

    def __init__(self, index: int):
        self.index = index
        self.proc: AsyncWorker | None = None
        self.peers: dict[str, RemotePeer] = {}
        self.replies: dict[tuple[str, str], asyncio.Future] = {}  # (sid, "answer" | "closed" | "pong") -> reply
        self.failure: str | None = None
        self.info: dict = {}  # its pong: pid, whether torch is imported
        self._reader: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return f"rtc worker {self.index} (pid {self.proc.pid if self.proc else '-'})"

    async def start(self) -> RtcWorkerProcess:
        self.proc = await start_worker_async("lipstream.serve.rtc_worker")
        self._reader = asyncio.ensure_future(self._read())
        # its imports done before the server is ready (they would take a first session's CPU)
        try:
            self.info = await self._call("", "pong", {"type": "ping"})
        except (asyncio.TimeoutError, RuntimeError) as e:
            await self.close()
            raise RuntimeError(f"{self.name} did not start: {e or 'no answer to a ping'}") from None
        return self

    @property
    def alive(self) -> bool:
        return self.failure is None and self.proc is not None and self.proc.returncode is None

    def send(self, header: dict, payload: bytes | memoryview = b"") -> None:
        if not self.alive:
            return  # its sessions are being closed (their `failed` ran)
        self.proc.stdin.writelines(frame_parts(header, payload))

    async def drain(self) -> None:
        if self.alive:
            try:
                await self.proc.stdin.drain()
            except (ConnectionError, BrokenPipeError):
                pass  # the reader sees the worker go and fails its sessions

    async def _call(self, sid: str, reply: str, header: dict) -> dict:
        if not self.alive:
            raise RuntimeError(self.failure or f"{self.name} is not running")
        future = self.replies[(sid, reply)] = asyncio.get_running_loop().create_future()
        self.send(header)
        try:
            return await wait_for(future, REPLY_TIMEOUT_S)
        finally:
            self.replies.pop((sid, reply), None)

    async def open_peer(self, sid: str, sdp: str, encoded: bool, audio_zero: float,
                        handlers: PeerHandlers) -> tuple[RemotePeer, str]:
        """The session's peer connection in this worker, and its SDP answer (ValueError: a bad offer)."""
        peer = self.peers[sid] = RemotePeer(self, sid, handlers)
        try:
            h = await self._call(sid, "answer", {"type": "open", "sid": sid, "sdp": sdp, "encoded": encoded,
                                                 "audio_zero": audio_zero})
        except BaseException:
            self.peers.pop(sid, None)
            self.send({"type": "close", "sid": sid})  # whatever the worker made of it goes (a late 'closed')
            raise
        return peer, h["sdp"]

    async def close_peer(self, sid: str) -> None:
        if self.peers.pop(sid, None) is None or not self.alive:
            return
        try:
            await self._call(sid, "closed", {"type": "close", "sid": sid})
        except (asyncio.TimeoutError, RuntimeError) as e:
            log.warning("%s did not close session %s: %s", self.name, sid, e)

    async def _read(self) -> None:
        why = None
        try:
            while True:
                message = await read_message_async(self.proc.stdout)
                if message is None:
                    why = ""
                    break
                header, payload = message
                try:
                    self._handle(header, payload)
                except Exception as e:  # noqa: BLE001 - a session's handler failed: that session's business
                    log.warning("%s, session %s: %s failed: %s", self.name, header.get("sid"), header.get("type"), e)
        except Exception as e:  # a broken reply: the worker cannot be trusted any more
            why = f"a broken reply ({e})"
        code = await self.proc.wait() if why == "" else None
        self.failure = f"{self.name} exited with code {code}" if why == "" else f"{self.name}: {why}"
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        self._fail_all()

    def _handle(self, h: dict, payload: memoryview) -> None:
        kind, sid = h.get("type"), h.get("sid", "")
        peer = self.peers.get(sid)
        if kind in ("answer", "closed", "pong") or (kind == "error" and (sid, "answer") in self.replies):
            future = self.replies.get((sid, "answer" if kind == "error" else kind))
            if future is not None and not future.done():
                if kind == "error":
                    future.set_exception(ValueError(h.get("message", "the offer was refused")))
                else:
                    future.set_result(h)
        elif peer is None:
            return  # a session already closed
        elif kind == "keyframe":
            peer.handlers.keyframe()
        elif kind == "mic":
            peer.handlers.mic(np.frombuffer(payload, np.float32).copy(), int(h["rate"]))
        elif kind == "state":
            peer.handlers.failed(h.get("why") or f"the connection {h.get('state')}")
        elif kind == "error":
            log.warning("%s, session %s: %s", self.name, sid, h.get("message"))

    def _fail_all(self) -> None:
        for future in self.replies.values():
            if not future.done():
                future.set_exception(RuntimeError(self.failure))
        peers, self.peers = list(self.peers.values()), {}
        if peers:
            log.error("%s; its %d sessions are closed", self.failure, len(peers))
        for peer in peers:
            peer.handlers.failed(self.failure)

    async def close(self) -> None:
        """EOF on its stdin ends it (its peers closed); killed if it does not go within 5 s."""
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self.proc.stdin.close()
            try:
                await wait_for(self.proc.wait(), 5.0)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._reader is not None:
            await self._reader


class RtcGateway:
    """`workers` RTC worker processes; each new session goes to the one with the fewest."""

    def __init__(self, workers: int):
        self.size = workers
        self.workers: list[RtcWorkerProcess] = []
        self._lock: asyncio.Lock | None = None

    async def start(self) -> RtcGateway:
        """The workers started together: each is a process that imports aiortc and PyAV before it answers
        (0.7 s apiece on the H100's host, one after another in a server's start)."""
        self._lock = asyncio.Lock()
        started = await asyncio.gather(*(RtcWorkerProcess(i).start() for i in range(self.size)),
                                       return_exceptions=True)
        failed = [x for x in started if isinstance(x, BaseException)]
        if failed:
            await asyncio.gather(*(w.close() for w in started if isinstance(w, RtcWorkerProcess)))
            raise failed[0]
        self.workers = list(started)
        return self

    async def pick(self) -> RtcWorkerProcess:
        """The live worker with the fewest sessions; a dead one is replaced first (one killed a moment ago,
        whose reader has not seen its end yet, is passed over)."""
        async with self._lock:
            for w in self.workers:
                if w.proc is not None:
                    w.proc.poll()  # its returncode, which `alive` reads, set if it has exited
            for i, w in enumerate(self.workers):
                if not w.alive and not w.peers:
                    await w.close()
                    self.workers[i] = await RtcWorkerProcess(w.index).start()
            alive = [w for w in self.workers if w.alive]
            if not alive:
                raise RuntimeError("no WebRTC worker is running")
            return min(alive, key=lambda w: len(w.peers))

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc is not None]

    async def close(self) -> None:
        for w in self.workers:
            await w.close()
