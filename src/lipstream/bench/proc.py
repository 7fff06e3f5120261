"""CPU seconds of another process (all its threads), read from /proc: what the benches charge a server
or an encode worker for."""

from __future__ import annotations

import os
from pathlib import Path


def process_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of process `pid`; None when there is none or it cannot be read (not
    Linux, or it is gone)."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def children_cpu_s(pid: int | None) -> float | None:
    """CPU seconds of `pid`'s child processes (the encode workers of a server), None as above."""
    if pid is None:
        return None
    try:
        kids = {int(k) for t in Path(f"/proc/{pid}/task").iterdir() for k in (t / "children").read_text().split()}
    except (OSError, ValueError):
        return None
    return sum(process_cpu_s(k) or 0.0 for k in kids)


def host_busy_s() -> float | None:
    """CPU seconds the whole machine spent busy (all cores, /proc/stat), None where it cannot be read."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")
