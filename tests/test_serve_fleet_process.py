"""`lipstream serve --replicas 1` as typed, a process of its own (issue 26), with each ingress (Ray Serve's
proxy, HAProxy): the local Ray it starts runs Serve's controller, the ingress and the replicas at the server's
own priority (Ray's default is 15 nicer), it is ready on /readyz, its port is served by the ingress asked for,
a live session speaks through it, and it stops cleanly on SIGINT even when started in a script's background
(SIGINT ignored there, so Python raises no KeyboardInterrupt), taking its Ray (and HAProxy) down with it.
Behind HAProxy, Ray's stats and metrics ports are held by another process (as a second fleet's would be):
HAProxy takes others, which the ready event names.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'lipstream[ray]')")

from lipstream.fixtures.avatar import tracked_avatar  # noqa: E402
from serve_process import descendants, free_port, listener, speaks  # noqa: E402

pytestmark = pytest.mark.slow  # Ray started by `lipstream serve --replicas` as typed: `make test` only

HAPROXY_DEFAULT_PORTS = (8404, 9101)  # stats, metrics: Ray's


def hold(ports: tuple[int, ...]) -> contextlib.ExitStack:
    """Something listening on each of `ports` on every interface (or already there: taken either way), until
    the stack returned is closed."""
    stack = contextlib.ExitStack()
    for port in ports:
        s = stack.enter_context(socket.socket())
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with contextlib.suppress(OSError):
            s.bind(("0.0.0.0", port))
            s.listen()
    return stack


# who listens on the server's port, and the processes of Serve that must run at its priority, by ingress
SERVES_PORT = {"ray": r"ray::ProxyActor", "haproxy": r"/haproxy "}
SERVING = {"ray": r"ray::(ServeController|ProxyActor|ServeReplica:lipstream:(engine|front))",
           "haproxy": r"ray::(ServeController|HAProxyManager|ServeReplica:lipstream:(engine|front))|/haproxy "}


@pytest.mark.parametrize("ingress", ["ray", "haproxy"])
def test_serve_replicas_as_typed_runs_at_its_own_priority_and_stops_on_sigint(tmp_path, tiny_models, ingress):
    tracked_avatar(tmp_path, "anna", tiny_models.vae, tiny_models.fingerprints["vae"], width=320, height=180, seed=0)
    port = free_port()
    env = {**os.environ, "LIPSTREAM_API_KEYS": "", "RAY_USAGE_STATS_ENABLED": "0"}
    log = open(tmp_path / "serve.log", "w")
    others = hold(HAPROXY_DEFAULT_PORTS if ingress == "haproxy" else ())
    server = subprocess.Popen(
        [sys.executable, "-m", "lipstream.cli", "serve", "--replicas", "1", "--avatars", str(tmp_path / "avatars"),
         "--data", str(tmp_path / "data"), "--random-weights", "--random-size", "tiny", "--device", "cpu",
         "--live-preset", "cpu", "--port", str(port), "--ingress", ingress,
         "--capacity-fps", "30"],  # given: a busy 2-core machine measured 2 frames/s and refused the session
        stdout=log, stderr=subprocess.STDOUT, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # a script's background job
    try:
        t = time.monotonic()
        while '"event": "ready"' not in (tmp_path / "serve.log").read_text():  # start done: a signal now stops it
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() - t < 240, "never ready: " + (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=10).status_code == 200
        assert re.search(SERVES_PORT[ingress], listener(port) or ""), listener(port)
        assert f'"ingress": "{ingress}"' in (tmp_path / "serve.log").read_text()
        if ingress == "haproxy":
            ready = next(json.loads(line) for line in (tmp_path / "serve.log").read_text().splitlines()
                         if line.startswith("{") and '"event": "ready"' in line)
            ports = ready["haproxy_ports"]
            assert set(ports) == {"stats", "metrics"} and not set(ports.values()) & {*HAPROXY_DEFAULT_PORTS, port}
            assert re.search(SERVES_PORT[ingress], listener(ports["stats"]) or ""), listener(ports["stats"])
        procs = descendants(server.pid)
        own = os.getpriority(os.PRIO_PROCESS, server.pid)
        serving = {pid: c for pid, c in procs.items() if re.search(SERVING[ingress], c)}
        # the controller, the ingress (HAProxy: its manager and the binary), the engine and the front
        assert len(serving) >= {"ray": 4, "haproxy": 5}[ingress], procs
        nice = {c[:50]: os.getpriority(os.PRIO_PROCESS, pid) for pid, c in serving.items()}
        assert set(nice.values()) == {own}, nice

        async def session() -> None:  # the signalling and the speech socket through the ingress
            from lipstream.client import connect

            live = await connect(f"http://127.0.0.1:{port}", "anna", fps=6)  # what 2 cores' engine admits
            try:
                await speaks(live, seconds=3.0)  # 18 pictures of speech
            finally:
                await live.aclose()

        asyncio.run(session())

        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=90) == 0
        assert '"event": "stopped"' in (tmp_path / "serve.log").read_text()
        time.sleep(1.0)
        alive = [pid for pid in procs if Path(f"/proc/{pid}").exists()
                 and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()]
        assert not alive, {pid: procs[pid][:60] for pid in alive}
    finally:
        left = descendants(server.pid)  # a failed test leaves no Ray behind
        if server.poll() is None:
            server.kill()
            server.wait()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        others.close()
        log.close()


def test_the_fleets_driver_does_not_import_torch(tmp_path, tiny_models):
    """The process that starts Ray and wires the front loads no networks (its replicas do): torch's import
    (2-3 s on a GPU host) would only delay Ray's start. Its command up to run_fleet, in a fresh process, on a
    free port (the default 8000 may be another server's: the command refuses a taken port first)."""
    tracked_avatar(tmp_path, "anna", tiny_models.vae, tiny_models.fingerprints["vae"], width=320, height=180, seed=0)
    probe = ("import sys\nimport lipstream.serve.fleet.start as fleet\n"
             "fleet.run_fleet = lambda *a, **k: print('torch' in sys.modules, 'ray' in sys.modules)\n"
             "from lipstream.cli import main\n"
             f"main(['serve', '--replicas', '1', '--port', '{free_port()}', '--avatars', "
             f"{str(tmp_path / 'avatars')!r}, '--data', {str(tmp_path / 'data')!r}, '--random-weights'])\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-2:] == ["False", "True"], out.stdout + out.stderr[-2000:]


def test_replicas_the_machines_gpus_cannot_hold_are_one_line_not_a_wait(tmp_path, tiny_models):
    """A local Ray cannot grow: Serve would wait for the GPUs forever, warning every 30 s. 64 replicas of one GPU
    each are more than any machine here has (none on the CPU)."""
    tracked_avatar(tmp_path, "anna", tiny_models.vae, tiny_models.fingerprints["vae"], width=320, height=180, seed=0)
    p = subprocess.run(
        [sys.executable, "-m", "lipstream.cli", "serve", "--replicas", "64", "--avatars", str(tmp_path / "avatars"),
         "--data", str(tmp_path / "data"), "--random-weights", "--random-size", "tiny", "--device", "cuda",
         "--port", str(free_port())],
        capture_output=True, text=True, timeout=180,
        env={**os.environ, "LIPSTREAM_API_KEYS": "", "RAY_USAGE_STATS_ENABLED": "0"})
    last = p.stderr.strip().splitlines()[-1]
    assert p.returncode == 1 and last.startswith("error: --replicas 64 with --device cuda: Ray sees"), p.stderr[-2000:]
    assert "GPU(s) on this machine, 1 for each replica" in last


def test_a_failed_start_is_said_in_one_line_from_rays_report():
    """What Ray raises when an actor of the start fails (HAProxy's own alert, or the cause's last line) or Serve
    gives the application up; anything else is not a failed start and is raised as it is."""
    import ray.exceptions

    from lipstream.serve.fleet.start import start_failure

    haproxy = RuntimeError("HAProxy crashed during startup: [NOTICE]   (19712) : haproxy version is 2.8.25\n"
                           "[WARNING]  (19712) : config : log format ignored\n"
                           "[ALERT]    (19712) : Binding [haproxy.cfg:95] for proxy stats: cannot bind socket "
                           "(Address already in use) for [0.0.0.0:8404]\n"
                           "[ALERT]    (19712) : Some protocols failed to start their listeners! Exiting.")
    task = ray.exceptions.RayTaskError("HAProxyManager.ready", "Traceback (most recent call last): ...", haproxy)
    assert start_failure(task) == ("Binding [haproxy.cfg:95] for proxy stats: cannot bind socket (Address already "
                                   "in use) for [0.0.0.0:8404]")
    bind = ray.exceptions.RayTaskError("ProxyActor.ready", "Traceback ...", RuntimeError(
        "Failed to bind to address '127.0.0.1:8770'."))
    assert start_failure(bind) == "Failed to bind to address '127.0.0.1:8770'."
    deploy = RuntimeError("Deploying application lipstream failed: Failed to update the deployments ['engine'].\n"
                          "Traceback (most recent call last):\n  File \"replica.py\", line 1, in __init__\n"
                          "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert start_failure(deploy) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert start_failure(ValueError("a bug")) is None
    assert start_failure(RuntimeError("something else")) is None


def test_a_start_that_fails_in_ray_ends_in_one_line_and_leaves_no_ray(tmp_path, tiny_models):
    """HAProxy that exits at once (a wrong RAY_SERVE_HAPROXY_BINARY_PATH): Ray's HAProxyManager fails the start;
    the user reads why in one line, not Ray's stack trace called a bug in LipStream."""
    tracked_avatar(tmp_path, "anna", tiny_models.vae, tiny_models.fingerprints["vae"], width=320, height=180, seed=0)
    server = subprocess.Popen(
        [sys.executable, "-m", "lipstream.cli", "serve", "--replicas", "1", "--avatars", str(tmp_path / "avatars"),
         "--data", str(tmp_path / "data"), "--random-weights", "--random-size", "tiny", "--device", "cpu",
         "--port", str(free_port()), "--ingress", "haproxy"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "LIPSTREAM_API_KEYS": "", "RAY_USAGE_STATS_ENABLED": "0",
             "RAY_SERVE_HAPROXY_BINARY_PATH": "/bin/false"})
    ray_processes: dict[int, str] = {}
    try:
        t = time.monotonic()
        while server.poll() is None and time.monotonic() - t < 180:
            ray_processes.update(descendants(server.pid))
            time.sleep(0.2)
        _, stderr = server.communicate(timeout=10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    last = stderr.strip().splitlines()[-1]
    assert server.returncode == 1, stderr[-2000:]
    assert last == "error: the fleet did not start: HAProxy crashed during startup: exit code 1 (Ray's log above " \
                   "says more)", stderr[-2000:]
    assert ray_processes, "Ray never started"
    time.sleep(1.0)
    alive = [pid for pid in ray_processes if Path(f"/proc/{pid}").exists()
             and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()]
    assert not alive, {pid: ray_processes[pid][:60] for pid in alive}


def test_the_gpu_check_counts_what_each_flag_asks_for():
    from lipstream.errors import LipStreamError
    from lipstream.serve.fleet.start import check_local_gpus

    check_local_gpus(1.0, 4, 4.0, "cuda", "--replicas")
    check_local_gpus(0.0, 64, 0.0, "cpu", "--replicas")  # CPU replicas take no GPU
    with pytest.raises(LipStreamError, match=r"^--max-replicas 8 with --device auto: Ray sees 4 GPU\(s\) on this "
                                             r"machine, 1 for each replica; ask for 4 at most$"):
        check_local_gpus(1.0, 8, 4.0, "auto", "--max-replicas")
