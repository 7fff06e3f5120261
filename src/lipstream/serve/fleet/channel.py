"""A fleet's speech from the front to a replica over a TCP connection of its own, not Ray calls.

Ray's handling of a call costs the replica's process GIL time on threads of Ray's own (its core worker's,
the replica's request wrapper, metrics), beside the engine's core thread: on 2 cores one session's speech
at 50 calls/s lost 19-59 frames of 240 a row, at 10 calls/s none (docs/BENCHMARKS.md). Here each replica
listens on its node's address; the front keeps one connection to each and sends what ReplicaSpeech
(serve/fleet/speech.py) batches as one message, the replica answering with the ids of the sessions that
have ended. Where a connection cannot be had, the front falls back to the Ray call (serve/fleet/front.py).

The wire is media/wire.py's, both ways. The front's first message is {"token": ...}, the fleet's secret;
the replica answers {"ok": true} or closes. A batch's header is {"batch": [[sid, [item, ...]], ...]}, each
item ["audio", nbytes, rate] (its PCM16 next in the payload, in order), ["end"] or ["interrupt"]; the
answer's is {"ended": [sid, ...]}. No pickle: a peer that is not the front can do nothing but be refused.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable

from lipstream.aio import wait_for
from lipstream.media.wire import pack, read_message_async
from lipstream.serve.fleet.speech import CHANNEL_BATCH_S, SPEECH_BATCH_S

log = logging.getLogger("lipstream.serve")
MAX_MESSAGE = 64 << 20  # a batch: 64 MiB of PCM is over half an hour of 16 kHz speech
COMMANDS = ("end", "interrupt")
CONNECT_TIMEOUT_S = 2.0  # a connection and its token's answer; else the Ray call, tried again later

Batch = dict[str, list[tuple]]  # {session id: [("audio", pcm16 bytes, rate) | ("end",) | ("interrupt",)]}


class ChannelError(Exception):
    """The peer broke the protocol, refused the token, or went away."""


async def read_message(reader: asyncio.StreamReader) -> tuple[dict, memoryview]:
    """wire.read_message_async, every way it can fail a ChannelError."""
    try:
        message = await read_message_async(reader, MAX_MESSAGE)
    except (EOFError, ConnectionError) as e:
        raise ChannelError(f"the connection ended: {type(e).__name__}") from e
    except ValueError as e:  # over the size, or a header that is not JSON
        raise ChannelError(f"a bad message: {e}") from e
    if message is None:
        raise ChannelError("the connection ended")
    if not isinstance(message[0], dict):
        raise ChannelError("a header that is not a JSON object")
    return message


def encode_batch(batch: Batch) -> bytes:
    sessions, pcm = [], []
    for sid, items in batch.items():
        out = []
        for item in items:
            if item[0] == "audio":
                out.append(["audio", len(item[1]), int(item[2])])
                pcm.append(item[1])
            else:
                out.append([item[0]])
        sessions.append([sid, out])
    return pack({"batch": sessions}, b"".join(pcm))


def decode_batch(header: dict, payload: bytes | memoryview) -> Batch:
    """The batch a message carries; ChannelError for anything but what encode_batch writes."""
    batch: Batch = {}
    at = 0
    try:
        for sid, items in header["batch"]:
            out = batch.setdefault(str(sid), [])
            for item in items:
                if item[0] == "audio":
                    n, rate = int(item[1]), int(item[2])
                    if n < 0 or at + n > len(payload):
                        raise ChannelError("an audio item past the payload's end")
                    out.append(("audio", bytes(payload[at:at + n]), rate))
                    at += n
                elif item[0] in COMMANDS and len(item) == 1:
                    out.append((item[0],))
                else:
                    raise ChannelError(f"an item that is not audio, end or interrupt: {item[0]!r}")
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise ChannelError(f"a malformed batch: {type(e).__name__}") from e
    if at != len(payload):
        raise ChannelError(f"{len(payload) - at} payload bytes no item names")
    return batch


class SpeechListener:
    """In a replica: the front's connections, each message a batch for `speak_many` (the replica's own
    method, on its event loop), answered with the ended ids."""

    def __init__(self, speak_many: Callable[[Batch], Awaitable[list[str]]], token: str):
        self.speak_many, self.token = speak_many, token
        self._server: asyncio.Server | None = None
        self.batches = 0  # the batches that came this way (tests/test_serve_fleet.py)
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, host: str) -> int:
        """Listening on a free port of `host`; the port."""
        self._server = await asyncio.start_server(self._serve, host, 0)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """No more connections, and those open closed: the front's next batch goes by Ray's call."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        self._writers.add(writer)
        try:
            hello, _ = await wait_for(read_message(reader), 10.0)
            if not hmac.compare_digest(str(hello.get("token", "")).encode(), self.token.encode()):
                log.warning(json.dumps({"event": "speech_channel_refused", "peer": str(peer)}))
                return
            writer.write(pack({"ok": True}))
            await writer.drain()
            while True:
                batch = decode_batch(*await read_message(reader))
                self.batches += 1
                ended = await self.speak_many(batch)
                writer.write(pack({"ended": list(ended)}))
                await writer.drain()
        except ChannelError as e:
            if "the connection ended" not in str(e):
                log.warning(json.dumps({"event": "speech_channel_closed", "peer": str(peer), "why": str(e)}))
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()


class SpeechChannel:
    """In the front: one connection to a replica's SpeechListener, opened at the first batch; a call sends
    a batch and returns the ended ids. Any failure raises ChannelError (or OSError, TimeoutError) and
    closes the connection; the next call opens a new one."""

    def __init__(self, host: str, port: int, token: str, timeout_s: float):
        self.host, self.port, self.token, self.timeout_s = host, port, token, timeout_s
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        """The connection and the token's answer, within CONNECT_TIMEOUT_S."""
        try:
            await wait_for(self._connect(), CONNECT_TIMEOUT_S)
        except BaseException:
            self.close()
            raise

    async def __call__(self, batch: Batch) -> list[str]:
        if self._writer is None:
            await self.connect()
        try:
            return await wait_for(self._exchange(batch), self.timeout_s)
        except BaseException:
            self.close()
            raise

    async def _connect(self) -> None:
        self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        self._writer.write(pack({"token": self.token}))
        answer, _ = await read_message(self._reader)
        if answer.get("ok") is not True:
            raise ChannelError("the replica refused the token")

    async def _exchange(self, batch: Batch) -> list[str]:
        self._writer.write(encode_batch(batch))
        await self._writer.drain()
        answer, _ = await read_message(self._reader)
        ended = answer.get("ended")
        if not isinstance(ended, list):
            raise ChannelError("an answer with no list of ended sessions")
        return [str(s) for s in ended]

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


class SpeechRoute:
    """A replica's speech call in the front (ReplicaSpeech's `call`): over a SpeechChannel to the address
    the replica advertises once it is connected, else the Ray call. The connection is made beside the
    speech, never in its way: batches go by Ray meanwhile, and a connection that fails is tried again after
    RETRY_S, doubling up to RETRY_MAX_S while it keeps failing (a port a firewall drops costs nothing but
    Ray's calls). A batch whose connection broke after it was sent goes again by the Ray call: a session may
    hear up to one batch twice (20 ms), rather than lose an "end" or be taken for gone."""

    RETRY_S, RETRY_MAX_S = 2.0, 60.0

    def __init__(self, name: str, address: Callable[[], tuple[str, int] | None], token: str,
                 ray_call: Callable[[Batch], Awaitable[list[str] | None]], timeout_s: float):
        self.name, self.address, self.token, self.ray_call, self.timeout_s = name, address, token, ray_call, timeout_s
        self._channel: SpeechChannel | None = None  # connected
        self._connecting: asyncio.Task | None = None
        self._retry_at, self._backoff = 0.0, self.RETRY_S

    async def __call__(self, batch: Batch) -> list[str] | None:
        if self._channel is None:
            self._maybe_connect()
        if self._channel is not None:
            try:
                return await self._channel(batch)
            except (ChannelError, OSError, asyncio.TimeoutError) as e:
                self._failed("sending", e)
        return await self.ray_call(batch)

    def batch_s(self) -> float:
        """How often ReplicaSpeech may send now: a message on the channel costs the replica far less than
        a Ray call, so batches go twice as often while it is up."""
        return CHANNEL_BATCH_S if self._channel is not None else SPEECH_BATCH_S

    def _maybe_connect(self) -> None:
        if not self.token or self._connecting is not None or time.monotonic() < self._retry_at:
            return
        address = self.address()
        if address is None:
            return
        channel = SpeechChannel(address[0], int(address[1]), self.token, self.timeout_s)

        async def connect() -> None:
            try:
                await channel.connect()
            except (ChannelError, OSError, asyncio.TimeoutError) as e:
                self._failed("connecting", e)
            else:
                self._channel, self._backoff = channel, self.RETRY_S
            finally:
                self._connecting = None

        self._connecting = asyncio.get_running_loop().create_task(connect())

    def _failed(self, doing: str, e: BaseException) -> None:
        log.warning(json.dumps({"event": "speech_channel_failed", "replica": self.name, "while": doing,
                                "error": f"{type(e).__name__}: {e}"[:200], "retry_s": self._backoff}))
        self._channel = None
        self._retry_at = time.monotonic() + self._backoff
        self._backoff = min(self.RETRY_MAX_S, 2 * self._backoff)

    def close(self) -> None:
        if self._connecting is not None:
            self._connecting.cancel()
        if self._channel is not None:
            self._channel.close()
            self._channel = None
