"""Ray Serve's request router for the engine replicas of a fleet: a call that names a replica goes to
that replica and no other (a live session lives in one replica's process: its speech, status and
end must reach it); a call that names none goes to the replica with the most room for live frames.

The front names a replica with the handle's `session_id` option (Ray Serve's own session-stickiness
field, here holding the replica's unique id). The replicas report their room through
`record_routing_stats` (serve/fleet/replica.py); Ray's controller hands every router the replicas
with their latest figures, which the front also reads here to list the fleet (`fleet_replicas`).
"""

from __future__ import annotations

import importlib
import weakref

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

_routers: weakref.WeakSet = weakref.WeakSet()  # this process's routers (the front's handle has one)


def room(stats: dict) -> float:
    """Frames/s of live sessions a replica can still take, from its routing stats (inf: it has no capacity
    figure); -1 before it has reported, or with no session place free."""
    if not stats.get("ready") or stats.get("places", 0) <= 0:
        return -1.0
    free = stats.get("room_fps")
    return float("inf") if free is None else float(free)


def room_of(replica: RunningReplica) -> float:
    return room(replica.routing_stats or {})


class SessionAffineRouter(RequestRouter):
    """Named replica only (a request waits while it is not known: the caller bounds the wait); else the
    replicas by room, most first."""

    def initialize_state(self, **kwargs) -> None:
        # Ray ships a custom router's module by value (RequestRouterConfig pickles it so): this class's
        # globals are a copy. It joins the set of the module as imported here, which fleet_replicas reads.
        importlib.import_module(__name__)._routers.add(self)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        target = pending_request.metadata.session_id if pending_request is not None else ""
        if target:
            named = [r for r in candidate_replicas if r.replica_id.unique_id == target]
            if not named:
                pending_request.routing_context.should_backoff = True
            return [named]
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        ranked = sorted(candidate_replicas, key=room_of, reverse=True)
        return [[r] for r in ranked]


def fleet_replicas(deployment: str) -> dict[str, dict]:
    """The replicas of `deployment` this process's routers know (Ray's controller keeps them current: a
    dead replica leaves the list), by unique id, with their last routing stats."""
    out: dict[str, dict] = {}
    for router in list(_routers):
        for rid, replica in router.curr_replicas.items():
            if rid.deployment_id.name == deployment:
                out[rid.unique_id] = dict(replica.routing_stats or {})
    return out
