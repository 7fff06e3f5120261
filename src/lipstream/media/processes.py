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
# for a pipe; benchmarks/pipe_replies.py on a 2-core machine, 2026-12-05).
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


async def start_worker_async(module: str) -> asyncio.subprocess.Process:
    """A worker whose pipes an event loop reads and writes."""
    argv, env = worker_command(module)
    return await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, env=env, limit=PIPE_LIMIT)
