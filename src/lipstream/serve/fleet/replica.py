"""One engine replica of a `lipstream serve` fleet (deployed by serve/fleet/start.py): a Ray Serve replica that owns a GPU
and holds what a single-process server holds (the networks, the resident avatars, a LiveEngine, the
WebRTC workers, a job runner on the shared store), warm before Ray sends it anything.

Its methods are what the fleet's front calls through the engine deployment's handle: the live
session calls (each named by the session's id, whose first part is this replica's unique id), the
avatars, the metrics. Jobs need no call: the runner pulls them from the shared store. A live
session's media goes from this replica's WebRTC workers straight to the client (ICE gives the
client this host's addresses); only signalling and speech pass through the front.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from lipstream.aio import wait_for
from lipstream.serve.auth import Caller
from lipstream.serve.fleet.channel import SpeechListener
from lipstream.live.interface import SessionRefused
from lipstream.serve.interface import SessionGone
from lipstream.serve.options import ServeOptions

EVENT_POLL_S = 0.5  # how often an event stream looks whether its session has ended
FLEET_JOB_POLL_S = 0.05  # a replica's idle job runner looks at the shared store this often (a job submitted
# at the front wakes no runner: at the plain server's 0.2 s, a job waited 0.1 s on average before it ran)


@dataclass(frozen=True)
class EngineWeights:
    """The networks each replica loads: the CLI's --models / --random-weights / --random-size / --device /
    --compile, resolved in the replica (its own GPU)."""

    models: Path | None = None
    random_weights: bool = False
    random_size: str = "auto"
    device: str = "auto"
    compile: str = "auto"  # on, off, auto (on for CUDA)

    def load(self):
        """startup.LiveNetworks: the packages `lipstream warmup` built on this replica's machine, or the modules."""
        from lipstream.models.config import random_size_for
        from lipstream.engine.networks import load_live_networks, pick_device

        device = pick_device(self.device)
        size = random_size_for(self.random_size, device.type)
        # background=False: a replica is warm before it takes traffic, so it compiles with Inductor at start
        # where the packages are missing (its steps never change under it)
        return load_live_networks(self.models, device, self.random_weights, size, compile=self.compile,
                                  background=False)


class EngineReplica:
    """A Service in a Ray Serve replica. Session ids begin with "<replica id>."."""

    async def __init__(self, options: ServeOptions, weights: EngineWeights, channel_token: str = ""):
        """`channel_token`: the fleet's secret for the front's speech connections (serve/fleet/channel.py);
        empty: speech comes by Ray calls only."""
        import ray
        from ray import serve

        from lipstream.serve.logs import json_logs
        from lipstream.serve.service import Service

        json_logs()
        self.name = serve.get_replica_context().replica_id.unique_id
        self.speech_calls = self.speech_session_batches = 0
        options = dataclasses.replace(options, runner_id=f"{options.runner_id}-{self.name}",
                                      job_poll_s=min(options.job_poll_s, FLEET_JOB_POLL_S))

        def start() -> Service:
            nets = weights.load()
            return Service(options, nets.models, inductor=nets.inductor, compiled=nets.compiled,
                           session_prefix=f"{self.name}.").start()

        self.service = await asyncio.to_thread(start)
        await self.service.start_serving()
        self.channel: tuple[str, int] | None = None  # where the front's speech connections come
        self.listener: SpeechListener | None = None
        if channel_token:
            self.listener = SpeechListener(self.speak_many, channel_token)
            host = ray.util.get_node_ip_address()
            self.channel = (host, await self.listener.start(host))

    async def __del__(self) -> None:
        """Ray Serve's graceful stop (a rolling update, scale-down, `serve.delete`): sessions closed, the
        running job back to the queue for another replica."""
        listener = getattr(self, "listener", None)
        if listener is not None:
            await listener.close()
        service = getattr(self, "service", None)
        if service is not None:
            self.service = None
            await service.stop_serving()

    def check_health(self) -> None:
        """Ray Serve's health probe: a failed engine makes this replica be replaced."""
        if self.service is None or self.service.live.failed():
            raise RuntimeError(f"engine replica {self.name}: its live engine has failed")

    def record_routing_stats(self) -> dict:
        """What SessionAffineRouter and the front read (serve/fleet/router.py)."""
        s = self.service
        room, places = s.live.room()
        return {"ready": s.ready and s.failure() is None, "room_fps": room, "places": places, "sessions": len(s.sessions.open),
                "job": s.runner.running, "avatars": sorted(s.avatars), "runner_id": s.o.runner_id,
                "speech_channel": self.channel}

    # --- live sessions: serve/interface.py's SessionHost, over the handle ---------------------------

    async def open_session(self, owner: str, avatar: str, offer: str, playout_delay_s: float | None,
                           fps: Fraction | None, latency: str | None = None) -> dict:
        """{"sid", "answer"}, or {"status", "detail"} when refused (an exception's class would not cross
        the handle reliably)."""
        try:
            sid, answer = await self.service.sessions.open_for(owner, avatar, offer, playout_delay_s, fps, latency)
        except SessionRefused as e:
            return {"status": e.status, "detail": e.detail}
        return {"sid": sid, "answer": answer}

    async def owned(self, owner: str) -> int:
        return await self.service.sessions.owned(owner)

    async def listing(self, who: Caller) -> list[dict]:
        return await self.service.sessions.listing(who)

    async def status(self, sid: str, who: Caller) -> dict | None:
        return await self.service.sessions.status(sid, who)

    async def close_for(self, sid: str, who: Caller) -> bool:
        return await self.service.sessions.close_for(sid, who)

    async def has_session(self, sid: str, who: Caller) -> bool:
        return await self.service.sessions.speech(sid, who) is not None

    async def speak_many(self, batch: dict[str, list[tuple]]) -> list[str]:
        """What the front's speech sockets sent since its last call, for every session of this replica with
        something new (serve/fleet/speech.py's ReplicaSpeech), each session's items in order: ("audio",
        PCM16 bytes, rate), ("end",), ("interrupt",), ("switch", avatar). The ids of those sessions that have
        ended. Called by the front's connection (SpeechListener) or, where it has none, through the handle."""
        from lipstream.serve.live import LocalSpeech

        self.speech_calls += 1
        self.speech_session_batches += len(batch)
        ended = []
        for sid, items in batch.items():
            live = self.service.sessions.open.get(sid)
            if live is None:
                ended.append(sid)
                continue
            link = LocalSpeech(self.service.sessions, live)
            try:
                for item in items:
                    if item[0] == "audio":
                        await link.push(item[1], item[2])
                    elif item[0] == "switch":
                        await link.switch(item[1])
                    else:
                        await link.command(item[0])
            except SessionGone:
                ended.append(sid)
        return ended

    def speech_counts(self) -> dict:
        """The speech calls this replica has had, and the sessions' batches they carried (their sum over
        the calls): what shows the front's multiplexing (tests/test_serve_fleet.py)."""
        return {"calls": self.speech_calls, "session_batches": self.speech_session_batches,
                "by_channel": self.listener.batches if self.listener is not None else 0}

    async def events(self, sid: str):
        """The session's speech events as they come (a streaming call); ends when the session does."""
        sessions = self.service.sessions
        live = sessions.open.get(sid)
        while live is not None and sessions.open.get(sid) is live:
            try:
                event = await wait_for(live.events.get(), EVENT_POLL_S)
            except asyncio.TimeoutError:
                continue
            if event is None:  # the session's last (LiveSessions.close)
                return
            yield event

    # --- the rest of ServerHost, per replica --------------------------------------------------------

    async def avatar_list(self) -> list[dict]:
        return self.service.avatar_rows()

    async def metrics_text(self) -> bytes:
        return self.service.metrics.text()
