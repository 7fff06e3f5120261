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


def worker_command(module: str) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of a worker process running `module`."""
    env = dict(os.environ)
    root = str(Path(lipstream.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return [sys.executable, "-m", module], env


def start_worker(module: str) -> subprocess.Popen:
    """A worker whose pipes a thread reads and writes (blocking)."""
    argv, env = worker_command(module)
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)


async def start_worker_async(module: str) -> asyncio.subprocess.Process:
    """A worker whose pipes an event loop reads and writes."""
    argv, env = worker_command(module)
    return await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE, env=env, limit=PIPE_LIMIT)
