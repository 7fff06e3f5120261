"""`lipstream serve` in a process of its own for tests: started on a free loopback port, ready, stopped."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process readable in /proc: a server's Ray and workers."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                ppid = int(re.search(r"^PPid:\s+(\d+)", (d / "status").read_text(), re.M).group(1))
            except (OSError, AttributeError):
                continue
            out[int(d.name)] = (ppid, cmd)
    return out


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every process below `root`."""
    table, out, todo = processes(), {}, [root]
    while todo:
        p = todo.pop()
        for pid, (ppid, cmd) in table.items():
            if ppid == p and pid not in out:
                out[pid] = cmd
                todo.append(pid)
    return out


@contextlib.contextmanager
def serve_process(args: list, env: dict[str, str], log: Path, ready_s: float = 180.0) -> Iterator[str]:
    """`lipstream serve ARGS --port P` with `env`, its log in a file (not a pipe nobody reads): its URL once
    /readyz answers 200; terminated on the way out."""
    port = free_port()
    with open(log, "ab") as f:
        proc = subprocess.Popen([sys.executable, "-m", "lipstream", "serve", *map(str, args), "--port", str(port)],
                                env=env, stdout=subprocess.DEVNULL, stderr=f)
    url = f"http://127.0.0.1:{port}"
    try:
        t = time.monotonic()
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                if httpx.get(f"{url}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() - t < ready_s, \
                f"the server did not get ready in {ready_s:g} s; its log ends: " + log.read_text()[-1500:]
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)
