"""The fleet's speech connection (serve/fleet/channel.py) without Ray: a SpeechListener on loopback with a
plain function as the replica's speak_many, the front's SpeechChannel and SpeechRoute against it. Batches
arrive as sent (audio bytes, rates, commands in order), the answer's ended ids come back, a wrong token or
a malformed message gets nothing, and where the connection fails the Ray call (here a function) takes over."""

from __future__ import annotations

import asyncio
import json
import struct

import pytest

from lipstream.serve.fleet.channel import (ChannelError, SpeechChannel, SpeechListener, SpeechRoute, decode_batch,
    encode_batch, read_message)
from lipstream.serve.fleet.speech import CHANNEL_BATCH_S, SPEECH_BATCH_S


class Replica:
    """speak_many as a plain function: records the batches, answers `ended`."""

    def __init__(self, ended=()):
        self.batches, self.ended = [], list(ended)

    async def __call__(self, batch):
        self.batches.append(batch)
        return self.ended


BATCH = {"r1.a": [("audio", b"\x01\x02" * 160, 16000), ("end",), ("audio", b"\x03\x04" * 80, 24000)],
         "r1.b": [("interrupt",)], "r1.c": [("audio", b"", 16000)]}


def test_a_batch_encodes_and_decodes_as_it_was():
    message = encode_batch(BATCH)
    (n_body,) = struct.unpack("<I", message[:4])  # media/wire.py's framing
    header, payload = json.loads(message[4:].split(b"\n", 1)[0]), message[4:].split(b"\n", 1)[1]
    assert len(message) == 4 + n_body and len(payload) == 320 + 160
    assert decode_batch(header, payload) == BATCH
    with pytest.raises(ChannelError, match="past the payload"):
        decode_batch(header, payload[:-1])
    with pytest.raises(ChannelError, match="no item names"):
        decode_batch(header, payload + b"x")
    with pytest.raises(ChannelError, match="not audio, end or interrupt"):
        decode_batch({"batch": [["s", [["eval", "x"]]]]}, b"")
    with pytest.raises(ChannelError, match="malformed"):
        decode_batch({"batch": 3}, b"")


def test_batches_go_over_one_connection_and_the_ended_ids_come_back():
    async def main():
        replica = Replica(ended=["r1.b"])
        listener = SpeechListener(replica, "secret")
        port = await listener.start("127.0.0.1")
        channel = SpeechChannel("127.0.0.1", port, "secret", timeout_s=5)
        try:
            assert await channel(BATCH) == ["r1.b"]
            assert await channel({"r1.a": [("audio", b"\x00\x01", 16000)]}) == ["r1.b"]
        finally:
            channel.close()
            await listener.close()
        assert replica.batches == [BATCH, {"r1.a": [("audio", b"\x00\x01", 16000)]}]
        assert listener.batches == 2

    asyncio.run(main())


def test_a_wrong_token_or_a_malformed_message_gets_nothing_and_the_listener_goes_on():
    async def main():
        replica = Replica()
        listener = SpeechListener(replica, "secret")
        port = await listener.start("127.0.0.1")
        try:
            with pytest.raises(ChannelError):
                await SpeechChannel("127.0.0.1", port, "guess", timeout_s=5)(BATCH)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)  # a peer that sends garbage
            writer.write(struct.pack("<I", 1 << 30))  # a body of 1 GiB announced
            await writer.drain()
            with pytest.raises(ChannelError, match="ended"):
                await read_message(reader)
            writer.close()
            assert replica.batches == []
            channel = SpeechChannel("127.0.0.1", port, "secret", timeout_s=5)
            assert await channel(BATCH) == []  # the listener still serves the front
            channel.close()
        finally:
            await listener.close()
        assert replica.batches == [BATCH]

    asyncio.run(main())


class QuickRoute(SpeechRoute):
    RETRY_S, RETRY_MAX_S = 0.05, 0.2


def test_the_route_goes_by_ray_until_connected_falls_back_and_comes_back():
    async def main():
        replica, by_ray = Replica(ended=["r1.a"]), Replica(ended=[])
        listener = SpeechListener(replica, "secret")
        port = await listener.start("127.0.0.1")
        address = {"value": None}  # what the replica's routing stats say
        route = QuickRoute("r1", lambda: address["value"], "secret", by_ray, timeout_s=5)
        try:
            assert await route(BATCH) == []  # no address advertised yet: the Ray call
            assert route.batch_s() == SPEECH_BATCH_S  # Ray's calls: batches as often as they afford
            address["value"] = ("127.0.0.1", port)
            assert await route(BATCH) == []  # connecting beside it: this batch still by Ray, not held up
            await asyncio.sleep(0.05)
            assert await route(BATCH) == ["r1.a"]  # connected
            assert len(by_ray.batches) == 2 and len(replica.batches) == 1
            assert route.batch_s() == CHANNEL_BATCH_S < SPEECH_BATCH_S  # the channel's: more often
            await listener.close()  # the replica's listener goes, its connection with it
            assert await route(BATCH) == []  # the connection fails: this batch by the Ray call
            assert route.batch_s() == SPEECH_BATCH_S
            assert await route(BATCH) == []  # within RETRY_S: by Ray, no connection tried
            assert len(by_ray.batches) == 4 and route._connecting is None
            port = await listener.start("127.0.0.1")
            address["value"] = ("127.0.0.1", port)
            await asyncio.sleep(0.06)
            assert await route(BATCH) == []  # after RETRY_S: connecting again, by Ray meanwhile
            await asyncio.sleep(0.05)
            assert await route(BATCH) == ["r1.a"]
            assert len(replica.batches) == 2 and len(by_ray.batches) == 5
        finally:
            route.close()
            await listener.close()

    asyncio.run(main())


def test_a_replica_that_cannot_be_reached_costs_only_ray_calls_tried_less_and_less_often():
    async def main():
        by_ray = Replica(ended=[])
        listener = SpeechListener(Replica(), "secret")
        port = await listener.start("127.0.0.1")
        await listener.close()  # a port nothing listens on
        route = QuickRoute("r1", lambda: ("127.0.0.1", port), "secret", by_ray, timeout_s=5)
        t = asyncio.get_running_loop().time()
        for _ in range(40):
            assert await route(BATCH) == []
            await asyncio.sleep(0.01)
        assert len(by_ray.batches) == 40
        assert route._backoff == QuickRoute.RETRY_MAX_S  # doubled at each failure, up to the most
        assert asyncio.get_running_loop().time() - t < 2.0  # no batch waited for a connection
        route.close()

    asyncio.run(main())
