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


def avatar_and_speech(root: Path, tiny_models, *, long: bool = False) -> Path:
    """`root` with the avatar "anna" (320x180, tracked) and speech files hello.wav (1.6 s), talk.wav (4 s) and,
    with `long`, long.wav (6 s): what the server tests render."""
    from lipstream.fixtures import speech_like, write_audio
    from lipstream.fixtures.avatar import tracked_avatar

    tracked_avatar(root, "anna", tiny_models.vae, tiny_models.fingerprints["vae"], width=320, height=180, seed=0)
    write_audio(root / "hello.wav", speech_like(1.6, 16_000, seed=3), 16_000)
    if long:
        write_audio(root / "long.wav", speech_like(6.0, 16_000, seed=4), 16_000)
    write_audio(root / "talk.wav", speech_like(4.0, 16_000, seed=5), 16_000)
    return root


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


def listener(port: int) -> str | None:
    """The command line of the process listening on TCP `port` (IPv4), from /proc: who serves a server's port."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:  # LISTEN on the port
            inodes.add(f"socket:[{fields[9]}]")
    for pid, (_, cmd) in processes().items():
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if str(fd.readlink()) in inodes:
                    return cmd
            except OSError:
                continue
    return None


async def listen(session, limit_s: float = 60.0, frames_wanted: int = 0) -> tuple[int, int, set]:
    """Read a live session until its utterance has finished and `frames_wanted` pictures came: (pictures,
    pictures with sound, speech events seen). The events come over the speech socket, the pictures over
    WebRTC behind the playout delay: on a loaded machine "finished" may come first, so the reading goes
    on for the pictures (up to 10 s after it)."""
    import numpy as np

    from lipstream.live import LiveFrame, SpeechEvent

    frames, loud, events = 0, 0, set()
    deadline = time.monotonic() + limit_s
    async for item in session:
        if isinstance(item, LiveFrame):
            frames += 1
            loud += bool(item.audio is not None and np.abs(item.audio).max() > 1e-3)
        elif isinstance(item, SpeechEvent):
            events.add(item.kind)
            if item.kind == "finished":
                deadline = min(deadline, time.monotonic() + 10.0)
        if ("finished" in events and frames >= frames_wanted) or time.monotonic() > deadline:
            break
    return frames, loud, events


async def speaks(session, seconds: float = 1.0) -> None:
    """Speech pushed over a live session's socket comes back as pictures, each with its audio, and speech
    events."""
    from lipstream.fixtures import speech_like

    session.push_audio(speech_like(seconds, 16_000, seed=1), 16_000)
    session.end_utterance()
    frames, loud, events = await listen(session, frames_wanted=20)
    assert "started" in events and "finished" in events, events
    assert frames >= 20 and loud >= 10, (frames, loud)


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
