"""CPU seconds of another process (all its threads), read from /proc: what the benches charge a server
or an encode worker for; and client processes that each report a JSON row (bots, rooms)."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
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


class CoresUsed:
    """How many cores this process (all its threads) and the whole machine kept busy between `start()` and
    `stop()`: a client process's own share and whether the machine it shares with the server was full."""

    def __init__(self):
        self._at = None

    def start(self) -> None:
        self._at = (time.monotonic(), time.process_time(), host_busy_s())

    def stop(self) -> dict:
        """{"process_cores", "host_busy_cores"} over the span (None where it cannot be read or never started)."""
        if self._at is None:
            return {"process_cores": None, "host_busy_cores": None}
        t0, cpu0, busy0 = self._at
        span, busy1 = max(1e-6, time.monotonic() - t0), host_busy_s()
        return {"process_cores": round((time.process_time() - cpu0) / span, 2),
                "host_busy_cores": round((busy1 - busy0) / span, 1) if busy0 is not None and busy1 is not None else None}


def cores_of_processes(rows: list[dict]) -> dict:
    """The client processes' own CPU (each row's `process_cores`: the median and the sum), beside how busy the
    machine was over their windows (the median of what each saw) and how many cores it has."""
    own = [r["process_cores"] for r in rows if r.get("process_cores") is not None]
    host = [r["host_busy_cores"] for r in rows if r.get("host_busy_cores") is not None]
    return {"process_cores_median": round(statistics.median(own), 2) if own else None,
            "process_cores_sum": round(sum(own), 1) if own else None,
            "host_busy_cores": round(statistics.median(host), 1) if host else None,
            "host_cores": os.cpu_count()}


CLIENT_NICE = 10  # client processes (viewers, bots, rooms) share the server's machine: they yield to it when cores
# are short, as they would not compete with it on machines of their own


def rows_of_processes(module: str, args: list[list[str]], timeout_s: float, env: dict) -> list[dict | str]:
    """`python -m module` once per entry of `args` (each given `--out FILE` as well), all at once, at CLIENT_NICE;
    each process's row read from its file, or, for one that wrote none, the last line it printed to stderr (for
    one still running after `timeout_s`, where its threads were)."""
    env = {**env, "PYTHONFAULTHANDLER": "1", "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                                                            env.get("PYTHONPATH", "")])}
    with tempfile.TemporaryDirectory(prefix="lipstream-clients-") as tmp:
        procs = []
        for k, more in enumerate(args):
            out = Path(tmp) / f"client{k}.json"
            procs.append((subprocess.Popen([sys.executable, "-m", module, *more, "--out", str(out)], env=env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                           preexec_fn=lambda: os.nice(CLIENT_NICE)), out))
        results: list[dict | str] = []
        deadline = time.monotonic() + timeout_s
        for p, out in procs:
            try:
                _, err = p.communicate(timeout=max(0.0, deadline - time.monotonic()))
                late = None
            except subprocess.TimeoutExpired:
                late = _where_it_hung(p)
                err = b""
            if out.exists():
                results.append(json.loads(out.read_text()))
            elif late is not None:
                results.append(f"no row after {timeout_s:.0f} s; where its threads were:\n{late}")
            else:
                lines = (err or b"").decode(errors="replace").strip().splitlines()
                results.append(lines[-1] if lines else f"exit {p.returncode}")
    return results


def _where_it_hung(p: subprocess.Popen) -> str:
    """A client past its time: SIGABRT, which its faulthandler (PYTHONFAULTHANDLER) answers with every thread's
    stack on stderr, then SIGKILL; what it printed from its waiting tasks (`tell_tasks_after`) on."""
    p.send_signal(signal.SIGABRT)
    try:
        _, err = p.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        _, err = p.communicate()
    text = (err or b"").decode(errors="replace")
    return text[max(text.find("tasks still waiting"), 0):].strip()[-15000:]  # its tasks (if told), its threads


def tell_tasks_after(seconds: float) -> None:
    """In a client process's running event loop: if it is still running `seconds` from now, print every task
    and where it waits to stderr (what a thread dump of an idle loop cannot show), for the parent to report
    of a client past its time."""
    import asyncio

    def tell() -> None:
        print(f"tasks still waiting after {seconds:.0f} s:", file=sys.stderr)
        for task in asyncio.all_tasks():
            task.print_stack(file=sys.stderr)
        sys.stderr.flush()

    asyncio.get_running_loop().call_later(seconds, tell)
