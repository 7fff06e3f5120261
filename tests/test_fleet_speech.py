"""The fleet front's speech multiplexing (serve/fleet/speech.py) without Ray: a ReplicaSpeech given a plain
async function as its call. What every socket of one replica sends goes out as one stream of calls, at most
one in flight and one every batch_s; a session's audio runs merged, commands in their place; a session the
replica says has ended (or all of a call's when it fails) raises SessionGone on its next push."""

from __future__ import annotations

import asyncio
import contextvars
import time

import pytest

from lipstream.serve.fleet.speech import FleetSpeech, ReplicaSpeech
from lipstream.serve.interface import SessionGone


async def _no_events():
    return
    yield


class FakeReplica:
    """A replica's speak_many as a plain function: records each call's batch and when it came, answers
    `ended` (ids, or None: the replica is gone), and holds its first call until `gate` is set."""

    def __init__(self, ended=(), hold_first: bool = False):
        self.batches: list[dict] = []
        self.starts: list[float] = []
        self.ended = ended
        self.in_flight = self.most_in_flight = 0
        self.gate = asyncio.Event()
        if not hold_first:
            self.gate.set()

    async def __call__(self, batch: dict[str, list[tuple]]):
        self.batches.append(batch)
        self.starts.append(time.monotonic())
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.gate.wait()
            await asyncio.sleep(0.001)
            return self.ended
        finally:
            self.in_flight -= 1


def _link(speech: ReplicaSpeech, sid: str) -> FleetSpeech:
    return FleetSpeech(sid, speech, _no_events)


async def _drained(speech: ReplicaSpeech) -> None:
    while not speech.idle:
        await asyncio.sleep(0.005)


def test_sessions_share_one_call_audio_merged_commands_in_order():
    async def main():
        replica = FakeReplica(hold_first=True)
        speech = ReplicaSpeech(replica, batch_s=0.04)
        a, b = _link(speech, "r.a"), _link(speech, "r.b")
        await a.push(b"\x01\x00", 16_000)
        await asyncio.sleep(0)  # the first call is out, held: what follows waits for the next
        assert replica.batches == [{"r.a": [("audio", b"\x01\x00", 16_000)]}]
        await a.push(b"\x02\x00", 16_000)
        await b.push(b"\x10\x00", 16_000)
        await a.push(b"\x03\x00", 16_000)
        await a.command("end")
        await b.command("interrupt")
        await b.switch("close-up")
        await a.push(b"\x04\x00", 16_000)
        await a.push(b"\x05\x00", 48_000)
        await b.push(b"\x11\x00", 16_000)
        await b.push(b"\x12\x00", 16_000)
        replica.gate.set()
        await _drained(speech)
        assert replica.batches[1:] == [{
            "r.a": [("audio", b"\x02\x00\x03\x00", 16_000), ("end",), ("audio", b"\x04\x00", 16_000),
                    ("audio", b"\x05\x00", 48_000)],
            "r.b": [("audio", b"\x10\x00", 16_000), ("interrupt",), ("switch", "close-up"),
                    ("audio", b"\x11\x00\x12\x00", 16_000)],
        }]
        assert all(type(x[1]) is bytes for batch in replica.batches for items in batch.values()
                   for x in items if x[0] == "audio")
        assert replica.most_in_flight == 1
        assert replica.starts[1] - replica.starts[0] >= 0.04 - 1e-3

    asyncio.run(main())


def test_an_ended_session_raises_session_gone_the_others_go_on():
    async def main():
        replica = FakeReplica(ended=["r.a"])
        speech = ReplicaSpeech(replica, batch_s=0.01)
        a, b = _link(speech, "r.a"), _link(speech, "r.b")
        await a.push(b"\x01\x00", 16_000)
        await b.push(b"\x02\x00", 16_000)
        await _drained(speech)
        with pytest.raises(SessionGone):
            await a.push(b"\x03\x00", 16_000)
        with pytest.raises(SessionGone):
            await a.command("end")
        replica.ended = []
        await b.push(b"\x04\x00", 16_000)
        await b.command("end")
        await _drained(speech)
        assert [batch for batch in replica.batches if "r.a" in batch] == [{"r.a": [("audio", b"\x01\x00", 16_000)],
                                                                           "r.b": [("audio", b"\x02\x00", 16_000)]}]
        assert replica.batches[-1] == {"r.b": [("audio", b"\x04\x00", 16_000), ("end",)]}

    asyncio.run(main())


def test_a_replica_gone_ends_the_sessions_of_its_call():
    """A call answered None (the replica is gone) or raising: every session it carried has ended."""

    async def main():
        for ended in (None, RuntimeError("lost")):
            calls = []

            async def call(batch):
                calls.append(batch)
                if isinstance(ended, Exception):
                    raise ended
                return ended

            speech = ReplicaSpeech(call, batch_s=0.01)
            a, b, c = _link(speech, "r.a"), _link(speech, "r.b"), _link(speech, "r.c")
            await a.push(b"\x01\x00", 16_000)
            await b.command("end")
            await _drained(speech)
            for link in (a, b):
                with pytest.raises(SessionGone):
                    await link.push(b"\x02\x00", 16_000)
            assert not c.gone  # it had sent nothing: its own call will tell
            await c.push(b"\x03\x00", 16_000)
            await _drained(speech)
            assert c.gone and len(calls) == 2

    asyncio.run(main())


def test_the_calls_do_not_grow_with_the_sessions():
    """16 sockets each sending a 20 ms chunk every 20 ms for 0.6 s: at most one call every batch_s, each
    carrying every session that sent something."""

    async def main():
        replica = FakeReplica()
        speech = ReplicaSpeech(replica, batch_s=0.04)
        links = [_link(speech, f"r.{k}") for k in range(16)]
        t = time.monotonic()
        for step in range(30):
            for link in links:
                await link.push(b"\x00\x00" * 320, 16_000)
            await asyncio.sleep(max(0.0, t + (step + 1) * 0.02 - time.monotonic()))
        await _drained(speech)
        seconds = time.monotonic() - t
        assert len(replica.batches) <= seconds / 0.04 + 1, (len(replica.batches), seconds)
        assert all(len(batch) == 16 for batch in replica.batches[1:]), [len(b) for b in replica.batches]
        for k in range(16):
            pcm = b"".join(x[1] for batch in replica.batches for x in batch.get(f"r.{k}", ()))
            assert pcm == b"\x00\x00" * 320 * 30

    asyncio.run(main())


REQUEST = contextvars.ContextVar("request", default=None)


def test_the_sender_does_not_run_in_the_context_of_the_socket_that_started_it():
    """Ray reads a handle call's request ids from a context variable: the sender must not carry the
    WebSocket request's (serve/fleet/speech.py's ReplicaSpeech says why)."""

    async def main():
        seen = []

        async def call(batch):
            seen.append(REQUEST.get())
            return []

        speech = ReplicaSpeech(call, batch_s=0.01)
        REQUEST.set("the socket's request")
        await _link(speech, "r.a").push(b"\x01\x00", 16_000)
        await _drained(speech)
        assert seen == [None]

    asyncio.run(main())
