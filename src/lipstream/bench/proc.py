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
