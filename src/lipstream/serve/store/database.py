"""Which job store a `--database` names: a path or sqlite:///PATH (SQLite, one machine), or
postgresql://... (PostgreSQL, a queue shared by servers on several machines). The stores import the
interface (base.py); this module imports them, so neither imports the other."""

from __future__ import annotations

from pathlib import Path

from lipstream.serve.store.base import DATABASES, LEASE_S, JobStore, JobStoreError, default_runner_id, redact
from lipstream.serve.store.postgres import PostgresJobStore
from lipstream.serve.store.sqlite import SqliteJobStore


def open_store(database: str | Path, *, runner_id: str | None = None, lease_s: float = LEASE_S) -> JobStore:
    """A path or sqlite:///PATH: the SQLite store; postgresql://...: the PostgreSQL store.
    JobStoreError (one line, no password) for anything else or a database that cannot be used; MissingExtra
    for a PostgreSQL address without psycopg (the postgres extra)."""
    runner_id = runner_id or default_runner_id()
    if not lease_s > 0:
        raise ValueError(f"lease_s must be > 0, not {lease_s}")
    if isinstance(database, Path):
        return SqliteJobStore(database, runner_id=runner_id, lease_s=lease_s)
    scheme = database.split("://", 1)[0].lower() if "://" in database else ""
    if scheme in ("postgresql", "postgres"):
        return PostgresJobStore(database, runner_id=runner_id, lease_s=lease_s)
    if scheme == "sqlite":
        path = database.split("://", 1)[1]
        if not path.startswith("/") or path == "/":
            raise JobStoreError(f"{database}: expected sqlite:///PATH (three slashes, then the file's path)")
        return open_store(Path(path[1:] if path.startswith("//") else path), runner_id=runner_id, lease_s=lease_s)
    if scheme or not database:
        raise JobStoreError(f"{redact(database)}: not a job store address; expected {DATABASES}")
    return open_store(Path(database), runner_id=runner_id, lease_s=lease_s)
