"""The job store of `lipstream serve`: what every store does, and `open_store` to pick one.

Two stores implement `JobStore`: SQLite (serve/store/sqlite.py, the default: one file beside the
outputs, nothing to install or run, one machine) and PostgreSQL (serve/store/postgres.py: one
database that servers on several machines share). The service uses only this interface.

Several runners may share one store. A claim records the runner's id and a lease (`lease_until`),
which the runner renews while the job runs (its heartbeat). `requeue_running` hands back only jobs
whose lease expired (their runner died or lost the database) and, at a runner's start or shutdown,
its own: a job is never run by two runners at once, and a dead runner's job is finished by another.
A runner id must be unique among the servers sharing a store and the same across a server's
restarts, so that a restart takes back its own jobs at once instead of waiting for their leases.
Only the runner that holds a job may move it on (progress, finish, fail, cancelled), so a runner that
lost its lease cannot publish a result: a result path is set only by `finish`, nothing partial is served.
"""

from __future__ import annotations

import json
import math
import re
import socket
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol

from lipstream.errors import LipStreamError

SCHEMA_VERSION = 2  # 2: runner_id and lease_until (several runners on one store)
KINDS = ("render", "broadcast", "compile")
STATUSES = ("queued", "running", "done", "failed", "cancelled")
ACTIVE_STATUSES = ("queued", "running")
MAX_ERROR_CHARS = 500
LEASE_S = 30.0  # a claim lasts this long unless renewed; the runner renews it every LEASE_S / 3
DATABASES = "a SQLite file path (or sqlite:///PATH) or postgresql://USER@HOST/DB"


class JobStoreError(LipStreamError):
    """The store cannot be used: not a database, unreachable, or written by a newer lipstream."""


@dataclass(frozen=True)
class Job:
    """One job as the store holds it. `result` is relative to the data folder (set only when
    done); `error` is one line (set only when failed); `attempts` counts claims, so a job requeued
    after a crash or a shutdown counts again. `runner_id` and `lease_until` (seconds since the
    epoch) name the runner that holds a running job and until when, unless it renews the lease."""

    id: str
    owner: str
    kind: str
    status: str
    params: dict
    progress: float
    result: str | None
    error: str | None
    cancel_requested: bool
    created_at: float
    started_at: float | None
    finished_at: float | None
    attempts: int
    runner_id: str | None = None
    lease_until: float | None = None


class JobStore(Protocol):
    """What the service and the runner use of a store (SQLite's and PostgreSQL's alike)."""

    runner_id: str
    lease_s: float

    def get(self, job_id: str, owner: str | None = None) -> Job | None:
        """The job, or None when there is none or (owner given) it is someone else's."""

    def list(self, owner: str | None = None, limit: int = 100) -> list[Job]:
        """The newest `limit` jobs (of `owner` when given), newest first."""

    def active(self, owner: str) -> int:
        """Queued + running jobs of `owner`."""

    def counts(self) -> dict[str, int]:
        """Jobs per status, every status present."""

    def version(self, job_id: str) -> int:
        """A number that changes whenever the job's row does (0: no such job)."""

    def submit(self, owner: str, kind: str, params: dict) -> Job:
        """A new queued job."""

    def claim_next(self, kinds: tuple[str, ...] | None = None) -> Job | None:
        """The oldest queued job, now running under this runner with a fresh lease."""

    def renew(self, job_id: str) -> bool:
        """Extend this runner's lease on a running job; False when it no longer holds it."""

    def set_progress(self, job_id: str, progress: float) -> None:
        """Progress of a job this runner holds."""

    def finish(self, job_id: str, result: str) -> Job:
        """running -> done with its result path (this runner's job only)."""

    def fail(self, job_id: str, error: str) -> Job:
        """running -> failed with a one-line error (this runner's job only)."""

    def mark_cancelled(self, job_id: str) -> Job:
        """running -> cancelled after a cancel request (this runner's job only)."""

    def cancel(self, job_id: str, owner: str | None = None) -> Job | None:
        """Ask a job to stop (any server may)."""

    def requeue_running(self, *, max_attempts: int | None = None, shutdown: bool = False,
                        own: bool = True) -> list[str]:
        """Running jobs whose lease expired (and, with `own`, this runner's) back to the queue."""

    def close(self) -> None:
        """Close the connection."""


def default_runner_id() -> str:
    """The machine's name: unique among servers on different machines, the same across restarts."""
    return socket.gethostname() or "lipstream"


def redact(database: str | Path) -> str:
    """The address without its password, for messages and logs."""
    return re.sub(r"(://[^/@:]*):[^/@]*@", r"\1:***@", str(database))


# -- what both stores check the same way -----------------------------------------------------------

def params_json(kind: str, params: dict) -> str:
    """The parameters as JSON text. ValueError for an unknown kind or parameters that are not a JSON object."""
    if kind not in KINDS:
        raise ValueError(f"job kind must be one of {KINDS}, not {kind!r}")
    if not isinstance(params, dict):
        raise ValueError(f"job params must be a dict, not {type(params).__name__}")
    try:
        return json.dumps(params, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"job params must be JSON-able: {e}") from None


def checked_progress(job_id: str, progress: float) -> float:
    if math.isnan(progress):
        raise ValueError(f"job {job_id}: progress must be a number in 0..1, not NaN")
    return min(1.0, max(0.0, float(progress)))


def check_result(job_id: str, result: str) -> None:
    """ValueError for an absolute path or one that climbs out with "..": the service serves files by this path."""
    parts = PurePosixPath(result.replace("\\", "/"))
    if not result or parts.is_absolute() or Path(result).is_absolute() or ".." in parts.parts:
        raise ValueError(f"job {job_id}: result must be a path inside the store's folder, not {result!r}")


def require_held(job_id: str, status: str | None, holder: str | None, runner_id: str,
                 allowed: tuple[str, ...], action: str) -> None:
    """ValueError unless the job exists, is in an allowed status and (when running) is this runner's."""
    if status is None:
        raise ValueError(f"job {job_id}: no such job, cannot {action}")
    if status not in allowed:
        raise ValueError(f"job {job_id} is {status}, not {' or '.join(allowed)}: cannot {action}")
    if status == "running" and holder != runner_id:
        raise ValueError(f"job {job_id} is held by runner {holder!r}, not {runner_id!r} (its lease expired): "
                         f"cannot {action}")


def one_line(error: str) -> str:
    """Whitespace (newlines included) collapsed to single spaces, cut to MAX_ERROR_CHARS."""
    line = " ".join(str(error).split()) or "unknown error"
    return line if len(line) <= MAX_ERROR_CHARS else line[:MAX_ERROR_CHARS - 1] + "…"


def crashed_error(max_attempts: int) -> str:
    return f"the server stopped {max_attempts} times while running this job; not run again"


def job_from_row(row) -> Job:
    """A Job from a row of either database (a mapping of column names)."""
    params = row["params"]
    return Job(id=row["id"], owner=row["owner"], kind=row["kind"], status=row["status"],
               params=json.loads(params) if isinstance(params, str) else params, progress=row["progress"],
               result=row["result"], error=row["error"], cancel_requested=bool(row["cancel_requested"]),
               created_at=row["created_at"], started_at=row["started_at"], finished_at=row["finished_at"],
               attempts=row["attempts"], runner_id=row["runner_id"], lease_until=row["lease_until"])
