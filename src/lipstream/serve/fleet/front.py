"""The front of a `lipstream serve` fleet: the HTTP app of a single server (serve/app.py, the same routes and
page) as a Ray Serve deployment in front of the engine replicas (serve/fleet/replica.py).

It is the fleet's ServerHost (serve/interface.py): jobs go to the shared store and data folder, where the
replicas' runners claim them (a claim is atomic: one replica a job; a dead replica's lease expires and
another takes the job); a new live session goes to the replica with the most room (the replicas' own
admission figures), and later calls for it to that replica only (its id begins with the replica's); the
whole fleet answers 503 only when every replica is full. The speech of all a replica's sessions goes to it
as one stream of batches (serve/fleet/speech.py) over a TCP connection of the front's own
(serve/fleet/channel.py; Ray calls where it cannot be had); a session's media flows by ICE between the
client and its replica's host. /metrics merges the replicas' own. serve/fleet/start.py deploys it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from fractions import Fraction

import ray
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from lipstream.aio import wait_for
from lipstream.live.interface import SessionRefused
from lipstream.serve.auth import Caller
from lipstream.serve.fleet.channel import SpeechRoute
from lipstream.serve.fleet.router import fleet_replicas, room
from lipstream.serve.fleet.speech import FleetSpeech, ReplicaSpeech
from lipstream.serve.options import ServeOptions
from lipstream.serve.store.database import open_store

log = logging.getLogger("lipstream.serve")
APP = "lipstream"
ENGINE = "engine"
CALL_TIMEOUT_S = 30.0  # a call to a named replica that does not answer by then: it is gone
FLEET_TOTALS = ("lipstream_live_sessions", "lipstream_live_frames_rendered", "lipstream_offline_frames",
                "lipstream_live_frames_late", "lipstream_engine_capacity_fps", "lipstream_ready")


def replica_of(sid: str) -> str:
    """The replica a session id names ("<replica>.<token>")."""
    return sid.split(".", 1)[0] if "." in sid else ""


class FleetSessions:
    """The fleet's live sessions (serve/interface.py's SessionHost): each call goes to the replica the
    session id names; a new one to the replica with the most room."""

    def __init__(self, front: FleetFront):
        self.front = front
        self._speech: dict[str, ReplicaSpeech] = {}  # by replica: its sessions' speech, one stream of calls

    async def call(self, sid: str, method: str, *args):
        """`method` on the session's replica; None when that replica is gone (or never was)."""
        return await self.call_replica(replica_of(sid), method, *args)

    async def call_replica(self, name: str, method: str, *args):
        """`method` on replica `name`; None when it is gone (or never was)."""
        if name not in self.front.replicas():
            return None
        try:
            return await wait_for(getattr(self.front.replica(name), method).remote(*args), CALL_TIMEOUT_S)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
            log.warning(json.dumps({"event": "replica_call_failed", "replica": name, "method": method,
                                    "error": type(e).__name__}))
            return None

    async def each(self, method: str, *args) -> dict[str, object]:
        """`method` on every replica, by replica; one that fails is left out. One after the other: calls made
        while serving one HTTP request share its request id, and Ray's router hands a chosen replica to the
        pending call of that id, so two at once to two replicas may each get the other's."""
        out = {}
        for name in list(self.front.replicas()):
            try:
                out[name] = await wait_for(getattr(self.front.replica(name), method).remote(*args),
                                                   CALL_TIMEOUT_S)
            except (ray.exceptions.RayError, asyncio.TimeoutError):
                continue
        return out

    async def open_for(self, owner: str, avatar: str, offer: str, playout_delay_s: float | None,
                       fps: Fraction | None, latency: str | None = None) -> tuple[str, str]:
        """The replicas by the room they last reported (every second), most first; each one's own admission
        decides. A replica reported full is still asked (it may have closed sessions since), so the fleet
        refuses only when every replica has refused."""
        replicas = self.front.replicas()
        ranked = sorted((n for n, stats in replicas.items() if avatar in stats.get("avatars", ())),
                        key=lambda n: room(replicas[n]), reverse=True)
        tried = []
        for name in ranked:
            try:
                answer = await wait_for(self.front.replica(name).open_session.remote(
                    owner, avatar, offer, playout_delay_s, fps, latency), CALL_TIMEOUT_S)
            except (ray.exceptions.RayError, asyncio.TimeoutError) as e:
                tried.append(f"{name}: {type(e).__name__}")
                continue
            if "sid" in answer:
                return answer["sid"], answer["answer"]
            if answer["status"] != 503:
                raise SessionRefused(answer["status"], answer["detail"])
            tried.append(f"{name}: {answer['detail']}")  # full since it last reported: the next one
        raise SessionRefused(503, f"every replica is full ({len(replicas)} replicas"
                                  + (f"; {'; '.join(tried)})" if tried else ")"))

    async def owned(self, owner: str) -> int:
        return sum((await self.each("owned", owner)).values())

    async def listing(self, who: Caller) -> list[dict]:
        return [row for rows in (await self.each("listing", who)).values() for row in rows]

    async def status(self, sid: str, who: Caller) -> dict | None:
        return await self.call(sid, "status", sid, who)

    async def close_for(self, sid: str, who: Caller) -> bool:
        return bool(await self.call(sid, "close_for", sid, who))

    async def speech(self, sid: str, who: Caller) -> FleetSpeech | None:
        if not await self.call(sid, "has_session", sid, who):
            return None
        name = replica_of(sid)
        return FleetSpeech(sid, self.replica_speech(name),
                           lambda: self.front.replica(name).options(stream=True).events.remote(sid))

    def close(self) -> None:
        for speech in self._speech.values():
            speech.call.close()

    def replica_speech(self, name: str) -> ReplicaSpeech:
        """Replica `name`'s ReplicaSpeech (made at its first socket; an idle one of a replica gone is let go)."""
        speech = self._speech.get(name)
        if speech is None:
            replicas = self.front.replicas()
            for gone in [n for n, s in self._speech.items() if n not in replicas and s.idle]:
                self._speech.pop(gone).call.close()

            async def speak_many(batch: dict[str, list[tuple]]):
                return await self.call_replica(name, "speak_many", batch)

            def address() -> tuple[str, int] | None:
                return self.front.replicas().get(name, {}).get("speech_channel")

            route = SpeechRoute(name, address, self.front.channel_token, speak_many, CALL_TIMEOUT_S)
            speech = self._speech[name] = ReplicaSpeech(route, batch_s=route.batch_s, name=name)
        return speech


class FleetFront:
    """The fleet's ServerHost: the HTTP app's routes run here, in a replica of the front deployment."""

    def __init__(self, options: ServeOptions, engine, channel_token: str = ""):
        self.o = options
        self.engine = engine
        self.channel_token = channel_token  # the replicas' speech connections (serve/fleet/channel.py)
        self.uploads_dir = options.data_dir / "uploads"
        self.results_dir = options.data_dir / "results"
        for d in (self.uploads_dir, self.results_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.store = open_store(options.job_database(), runner_id=f"{options.runner_id}-front", lease_s=options.lease_s)
        self.sessions = FleetSessions(self)
        self._handles: dict[str, object] = {}
        self.registry = CollectorRegistry()
        self.requests = Counter("lipstream_http_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=self.registry)

    def __serve_build_asgi_app__(self):
        from lipstream.serve.app import create_app

        return create_app(self)

    def replicas(self) -> dict[str, dict]:
        return fleet_replicas(ENGINE)

    def replica(self, name: str):
        """The engine handle that reaches replica `name` only (SessionAffineRouter)."""
        handle = self._handles.get(name)
        if handle is None:
            handle = self._handles[name] = self.engine.options(session_id=name)
        return handle

    # --- ServerHost -------------------------------------------------------------------------------

    def is_ready(self) -> bool:
        return any(stats.get("ready") for stats in self.replicas().values())

    def failure(self) -> str | None:
        return None  # a replica whose engine stopped reports not ready, and Ray Serve replaces it

    def has_avatar(self, name: str) -> bool:
        return any(name in stats.get("avatars", ()) for stats in self.replicas().values())

    async def avatar_list(self) -> list[dict]:
        rows: dict[str, dict] = {}
        for listing in (await self.sessions.each("avatar_list")).values():
            for row in listing:
                rows.setdefault(row["name"], row)
        return [rows[k] for k in sorted(rows)]

    def wake_runner(self) -> None:
        """Nothing to do: the replicas' runners look at the store every 0.2 s."""

    def count_request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    async def metrics_text(self) -> bytes:
        """The front's requests and the jobs (the shared store, once), each replica's own figures labelled
        `replica`, and their sums labelled replica="all"."""
        texts = await self.sessions.each("metrics_text")
        lines = [generate_latest(self.registry).decode()]
        lines.append("# HELP lipstream_jobs jobs by status\n# TYPE lipstream_jobs gauge\n")
        lines += [f'lipstream_jobs{{status="{k}"}} {v}\n' for k, v in self.store.counts().items()]
        lines.append("# HELP lipstream_fleet_replicas engine replicas ready\n# TYPE lipstream_fleet_replicas gauge\n"
                     f"lipstream_fleet_replicas {sum(1 for s in self.replicas().values() if s.get('ready'))}\n")
        lines.append(merged_metrics({n: t.decode() for n, t in texts.items()}))
        return "".join(lines).encode()

    async def start_serving(self) -> None:
        """The first call makes this process's router, which then follows the replicas. It waits for a
        replica to be up (on a GPU, minutes of capturing steps), in the background: the front serves
        (/readyz: 503 until a replica is ready) meanwhile."""
        self._first_call = asyncio.ensure_future(self.engine.avatar_list.remote())

    async def stop_serving(self) -> None:
        self._first_call.cancel()
        self.sessions.close()
        self.store.close()


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def merged_metrics(texts: dict[str, str]) -> str:
    """The replicas' exposition texts as one: each sample with its replica's name, and for the figures in
    FLEET_TOTALS a replica="all" sample with their sum (their jobs gauge is the front's to give: one store)."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    totals: dict[str, float] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            if family.name in ("lipstream_jobs", "lipstream_http_requests"):
                continue
            entry = families.setdefault(family.name, (family.documentation, family.type, []))
            for sample in family.samples:
                labels = {**sample.labels, "replica": replica}
                body = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
                entry[2].append(f"{sample.name}{{{body}}} {sample.value!r}")
                if family.name in FLEET_TOTALS and not sample.labels:
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    out = []
    for name, (doc, kind, samples) in families.items():
        if kind == "counter":  # the text format names a counter by its samples' name (the parser strips _total)
            name += "_total"
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n")
        out += [s + "\n" for s in samples]
        if name in totals:
            out.append(f'{name}{{replica="all"}} {totals[name]!r}\n')
    return "".join(out)


Front = serve.ingress()(FleetFront)
