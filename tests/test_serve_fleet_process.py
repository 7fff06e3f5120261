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
         "--live-preset", "cpu", "--port", str(port), "--ingress", ingress],
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
    (2-3 s on a GPU host) would only delay Ray's start. Its command up to run_fleet, in a fresh process."""
    tracked_avatar(tmp_path, "anna", tiny_models.vae, tiny_models.fingerprints["vae"], width=320, height=180, seed=0)
    probe = ("import sys\nimport lipstream.serve.fleet as fleet\n"
             "fleet.run_fleet = lambda *a, **k: print('torch' in sys.modules, 'ray' in sys.modules)\n"
             "from lipstream.cli import main\n"
             f"main(['serve', '--replicas', '1', '--avatars', {str(tmp_path / 'avatars')!r}, '--data', "
             f"{str(tmp_path / 'data')!r}, '--random-weights'])\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-2:] == ["False", "True"], out.stdout + out.stderr[-2000:]
