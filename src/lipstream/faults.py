"""Fault injection for tests of the server in real processes: a fault that cannot be had on demand (the GPU
out of memory on a machine without one, a full disk where mounting a small filesystem is not allowed)
raised at a named point, as SQLite's and FoundationDB's test hooks do.

Armed by one environment variable, read once when this module is imported:

    LIPSTREAM_FAULT=KIND:POINT[:TIMES][,KIND:POINT[:TIMES]...]

KIND is `oom` (torch.cuda.OutOfMemoryError, what CUDA raises), `enospc` (OSError ENOSPC, what a full
disk raises) or `crash` (RuntimeError: a bug, or a GPU fault that is not out of memory). POINT is where
it is raised: `job`, each batch of a render or broadcast job's frames (in the job runner, serve/jobs.py),
`step`, each step of the live engine's core that carries a job's frames (the GPU step live sessions
share, live/core.py; not the idle loops it renders for itself), `features`, each Whisper encode of live
sessions' speech (live/core.py), or `upload`, each uploaded file saved (serve/uploads.py). It fires at
the first TIMES passes through that point in the process (1 if left out), then never again. Unset, `inject` is one test of an empty tuple: the points are
once per batch, step or file, never per frame.
"""

from __future__ import annotations

import errno
import os
import threading

from lipstream.errors import UsageError

KINDS = ("oom", "enospc", "crash")
POINTS = ("job", "step", "features", "upload")
ENV = "LIPSTREAM_FAULT"


class _Armed:
    def __init__(self, kind: str, point: str, times: int):
        self.kind, self.point, self.left = kind, point, times
        self.lock = threading.Lock()


def _parse(text: str | None) -> tuple[_Armed, ...]:
    """The armed faults (none when unset); a one-line UsageError naming what is allowed for anything else."""
    armed = []
    for fault in filter(None, (text or "").split(",")):
        parts = fault.split(":")
        if len(parts) not in (2, 3) or parts[0] not in KINDS or parts[1] not in POINTS or (
                len(parts) == 3 and not parts[2].isdigit()):
            raise UsageError(f"{ENV}={text!r}: KIND:POINT[:TIMES] with KIND one of {', '.join(KINDS)} and POINT "
                             f"one of {', '.join(POINTS)} is allowed, several separated by commas")
        armed.append(_Armed(parts[0], parts[1], int(parts[2]) if len(parts) == 3 else 1))
    return tuple(armed)


_ARMED = _parse(os.environ.get(ENV))


def inject(point: str) -> None:
    """Raise the fault armed at `point` if it has passes left; else nothing."""
    if not _ARMED:
        return
    armed = next((a for a in _ARMED if a.point == point), None)
    if armed is None:
        return
    with armed.lock:
        if armed.left <= 0:
            return
        armed.left -= 1
    if armed.kind == "oom":
        import torch

        raise torch.cuda.OutOfMemoryError(f"CUDA out of memory (injected by {ENV} at {point})")
    if armed.kind == "crash":
        raise RuntimeError(f"a crash injected by {ENV} at {point}")
    raise OSError(errno.ENOSPC, f"No space left on device (injected by {ENV} at {point})")
