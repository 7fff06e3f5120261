"""The speech of a fleet's live sessions on its way from the front to their replicas (serve/fleet/front.py).

Each speech socket's FleetSpeech (serve/interface.py's SpeechLink) hands what its client sends to the
ReplicaSpeech of its session's replica, which sends the speech of all that replica's sessions as one
stream of calls. Nothing here imports Ray: a ReplicaSpeech makes its calls through the `call` it is
given (serve/fleet/channel.py's SpeechRoute: the front's own connection to the replica, else the handle
call; or a plain function in a test).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection

from lipstream.serve.interface import SessionGone

log = logging.getLogger("lipstream.serve")
# a replica's speech goes to it at most this often (what came meanwhile, at once). By Ray's calls: one
# client chunk's length, so a chunk waits at most one chunk for its call (at 40 ms the fleet's speech was
# 25-27 ms later at p99 than a plain server's on the H200); 50 calls/s per replica, whatever its sessions.
SPEECH_BATCH_S = 0.02
# over the front's own connection (serve/fleet/channel.py), whose messages cost the replica little: half
# that, a chunk's wait halved (at 20 ms the fleet's live p50 was 12-28 ms over a plain server's on an H100,
# its audio stage p99 10 ms); at most 100 messages/s per replica, still a few sessions' speech in each
CHANNEL_BATCH_S = 0.01

# {session id: [items in order]} -> the ids of those sessions that have ended; None: the replica is gone
SpeechCall = Callable[[dict[str, list[tuple]]], Awaitable[Collection[str] | None]]


class FleetSpeech:
    """One session's speech socket in the front: pushes and commands go into its replica's ReplicaSpeech;
    the events come from the replica as a streaming call (`events`: a function that opens it)."""

    def __init__(self, sid: str, speech: ReplicaSpeech, events: Callable[[], AsyncIterator[dict]]):
        self.sid, self.speech, self._events = sid, speech, events
        self.gone = False  # set by the ReplicaSpeech once the replica said the session has ended (or died)

    async def push(self, pcm16: bytes, rate: int) -> None:
        self.speech.put(self, ("audio", pcm16, rate))

    async def command(self, kind: str) -> None:
        self.speech.put(self, (kind,))

    async def switch(self, avatar: str) -> None:
        self.speech.put(self, ("switch", avatar))

    async def events(self):
        try:
            async for event in self._events():
                yield event
        except Exception:  # noqa: BLE001 (its replica died: the socket's sends end; its pushes see it)
            return


class ReplicaSpeech:
    """The speech of every session of one replica, as one stream of calls: at most one in flight and at
    most one every `batch_s` (in the fleet its route's, serve/fleet/channel.py's SpeechRoute.batch_s),
    each carrying {session id: [items in order]} for the sessions with something pending (a session's
    audio at one rate merged into one run of PCM; "end" and "interrupt" in their place among it). Why:
    Ray's handling of a call costs the replica's process GIL time beside the engine's core thread; a call
    per session per 40 ms was 400 calls/s at 16 sessions on the H200 (a call per 20 ms chunk: 800/s,
    speech 8 s behind). Per replica, the calls per second no longer grow with its
    sessions.

    The sender task runs in a fresh contextvars.Context, not the WebSocket request's that happened to
    start it: every handle call made in a request's context carries that request's internal id (ray
    serve/_private/default_impl.py's get_request_metadata reads it from serve/context.py's
    _serve_request_context; with none set, each call generates its own ids). Ray's router hands a replica
    chosen for one call to any pending call of the same id (request_router.py's
    _get_pending_request_matching_internal_request_id), and a cancelled request cancels the calls of its
    id still pending assignment (replica.py's _on_request_cancelled): one socket's id would mix with its
    own calls and take every session's speech down with it when that socket goes."""

    def __init__(self, call: SpeechCall, batch_s: float | Callable[[], float] = SPEECH_BATCH_S, name: str = ""):
        self.call, self.batch_s, self.name = call, batch_s, name  # batch_s: a figure, or asked before each wait
        self._pending: dict[FleetSpeech, list] = {}  # by socket, in the order they came
        self._sender: asyncio.Task | None = None

    @property
    def idle(self) -> bool:
        return not self._pending and (self._sender is None or self._sender.done())

    def put(self, link: FleetSpeech, item: tuple) -> None:
        """Queue one item of a socket's speech; SessionGone once its session has ended."""
        if link.gone:
            raise SessionGone(f"session {link.sid} has ended")
        items = self._pending.setdefault(link, [])
        if item[0] == "audio" and items and items[-1][0] == "audio" and items[-1][2] == item[2]:
            items[-1][1].extend(item[1])  # one run of PCM at one rate
        else:
            items.append(["audio", bytearray(item[1]), item[2]] if item[0] == "audio" else item)
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send(), context=contextvars.Context())

    async def _send(self) -> None:
        while self._pending:
            links, self._pending = self._pending, {}
            batch: dict[str, list[tuple]] = {}
            for link, items in links.items():
                if not link.gone:
                    batch.setdefault(link.sid, []).extend(
                        ("audio", bytes(x[1]), x[2]) if x[0] == "audio" else x for x in items)
            if not batch:
                continue
            t = time.monotonic()
            try:
                ended = await self.call(batch)
            except Exception as e:  # noqa: BLE001 (a call that fails in any way: as if the replica were gone)
                log.warning(json.dumps({"event": "speech_call_failed", "replica": self.name,
                                        "error": type(e).__name__}))
                ended = None
            ended = set(batch if ended is None else ended)
            for link in links:
                if link.sid in ended:
                    link.gone = True
            batch_s = self.batch_s() if callable(self.batch_s) else self.batch_s
            await asyncio.sleep(max(0.0, batch_s - (time.monotonic() - t)))
