"""The C heap handed back to the system after each session, job and segment.

A server that opens and closes sessions and runs jobs for days frees as much as it allocates, but glibc's
malloc keeps what is freed in its arenas (one per thread that allocated, dozens on a many-core machine) for
reuse, and the resident size creeps up: on 2 cores, sessions opened and closed one after another grew the
server by ~0.4 MiB a session in 12 MiB steps, and ran flat (and 275 MiB smaller) with glibc's arenas capped
by MALLOC_ARENA_MAX; a process encoding 1280x720 segments with x264 on 4 threads held 84 MiB of heap between
segments, 62 MiB trimmed. `malloc_trim(0)` hands the free pages of every arena back (about a millisecond).
The server calls it off its event loop, at most once every TRIM_EVERY_S; a WebRTC worker on its loop after
a session closed, as often at most; an encode worker after each segment and each session it closed (a
1280x720 segment of 32 frames took 0.92 s on 2 cores with or without it).
Elsewhere (musl, macOS) it is a no-op. Imports only the stdlib: the workers load no torch.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time

TRIM_EVERY_S = 5.0


def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_TRIM = _malloc_trim()
_lock = threading.Lock()
_last = 0.0


def give_back_heap(every_s: float = TRIM_EVERY_S) -> None:
    """malloc_trim(0), unless one ran less than `every_s` ago or another runs now (a thread's call: it takes
    each arena's lock for a moment)."""
    global _last
    if _TRIM is None or not _lock.acquire(blocking=False):
        return
    try:
        if time.monotonic() - _last < every_s:
            return
        _TRIM(0)
        _last = time.monotonic()
    finally:
        _lock.release()
