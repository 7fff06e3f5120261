"""Starting LipStream's worker processes (encode workers, WebRTC workers): one way, for both.

A worker is `python -m <module>` with this interpreter, its stdin and stdout the message pipes
(lipstream.media.wire), and the lipstream that the parent imported on its path: a checkout run from
source starts workers of the same checkout, not an installed copy.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import lipstream

PIPE_LIMIT = 1 << 26  # an asyncio reader's buffer: a 1080p I420 frame is 3 MB
# A worker's replies can be megabytes (a 32-frame 1080p segment's packets: ~4 MB), and a worker blocks in
# its write until the parent's reader thread has drained all but a pipe's worth, which that thread does
# 64 KB at a time, taking the GIL back for each. Beside two busy Python threads, 20 replies of 4.4 MB kept
# the writer blocked 0.86-6.1 s through a 64 KB pipe, 0.20-0.79 s through 1 MB (Linux's default ceiling
# for a pipe; measured on a 2-core machine, 2026-12-05).
REPLY_PIPE_BYTES = 1 << 20
F_SETPIPE_SZ = 1031  # Linux fcntl; Python names it from 3.10 on Linux only


def worker_command(module: str) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of a worker process running `module`."""
    env = dict(os.environ)
    root = str(Path(lipstream.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return [sys.executable, "-m", module], env


def start_worker(module: str) -> subprocess.Popen:
    """A worker whose pipes a thread reads and writes (blocking); its replies' pipe widened where the
    system allows (REPLY_PIPE_BYTES)."""
    argv, env = worker_command(module)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    widen_pipe(proc.stdout.fileno())
    return proc


def widen_pipe(fd: int, size: int = REPLY_PIPE_BYTES) -> int:
    """The pipe's capacity set to `size` where the system allows it (Linux); the capacity it has after."""
    try:
        import fcntl

        return fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", F_SETPIPE_SZ), size)
    except (ImportError, OSError):  # another system, or over /proc/sys/fs/pipe-max-size: as it was
        return -1


class AsyncWorker:
    """A worker process whose pipes an event loop reads and writes: `stdin` an asyncio StreamWriter, `stdout` a
    StreamReader, with asyncio.subprocess.Process's pid, returncode, wait() and kill().

    Started by subprocess.Popen, not asyncio.create_subprocess_exec: under uvloop (uvicorn's loop where it is
    installed, and Ray's in every actor) the child runs Python's after-fork handling before its exec, which
    on Python 3.12 frees the other threads' thread-locals. PyAV 19 keeps each thread's VideoReformatter in
    one, its swscale slice threads waiting on a condition variable: freed in the child, it waits forever
    for threads the child does not have, and uv_spawn holds the whole event loop until the child's exec
    (seen: a server's start hung). Popen's child runs no Python between fork and exec."""

    def __init__(self, proc: subprocess.Popen, stdin: asyncio.StreamWriter, stdout: asyncio.StreamReader):
        self._proc, self.stdin, self.stdout = proc, stdin, stdout

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """Set once wait() or kill() reaped the worker (its reader sees its end first, as EOF): no syscall per
        look, since RtcWorkerProcess.alive asks before every frame it sends."""
        return self._proc.returncode

    def poll(self) -> int | None:
        """Its exit code if it has exited (a syscall: for rare looks, such as picking a worker)."""
        return self._proc.poll()

    async def wait(self) -> int:
        while self._proc.poll() is None:  # a worker's exit is rare: polled rather than a thread blocked on it
            await asyncio.sleep(0.02)
        return self._proc.returncode

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()


async def start_worker_async(module: str) -> AsyncWorker:
    """A worker whose pipes an event loop reads and writes (AsyncWorker: why not create_subprocess_exec)."""
    argv, env = worker_command(module)
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    loop = asyncio.get_running_loop()
    try:
        reader = asyncio.StreamReader(limit=PIPE_LIMIT)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), proc.stdout)
        transport, protocol = await loop.connect_write_pipe(
            lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()), proc.stdin)  # its drain() for the writer
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return AsyncWorker(proc, asyncio.StreamWriter(transport, protocol, None, loop), reader)
