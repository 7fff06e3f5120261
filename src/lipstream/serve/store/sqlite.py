"""The SQLite job store: render, broadcast and compile jobs in one file (the default, one machine).

Why SQLite: it is in the standard library (nothing to install or run beside the service), the
whole queue is one file next to the outputs, and its transactions are atomic and survive a crash
of the process: a job is never half-claimed or half-finished, and two threads or two processes
on the same file never claim the same job (claims take the write lock with BEGIN IMMEDIATE).
The file is in WAL mode, so readers (the /jobs listing, the server-sent-event polls) do not wait
for a writer; synchronous=NORMAL: a crash of the process loses nothing, a power cut may lose the
last commits but never corrupts the file.

What survives a restart: every job with its owner, parameters, status, progress, result path,
error, timestamps and attempt count. What does not: the work of a job that was running; the
service calls `requeue_running` at start-up (after a crash) and on a graceful shutdown, so its
own running jobs are queued again and start over, their claims counted in `attempts`. Several
processes on one machine may share the file, each with its own runner id (serve/store/base.py: leases).
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from pathlib import Path

from lipstream.serve.store.base import (ACTIVE_STATUSES, LEASE_S, SCHEMA_VERSION, STATUSES, Job, JobStoreError,
    check_result, checked_progress, crashed_error, default_runner_id, job_from_row, one_line, params_json,
    require_held)

BUSY_TIMEOUT_S = 10.0  # another process holding the write lock: wait this long before "database is locked"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- submission order: oldest first without ties on created_at
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    params TEXT NOT NULL,                   -- JSON
    progress REAL NOT NULL DEFAULT 0,
    result TEXT,
    error TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    version INTEGER NOT NULL DEFAULT 1,     -- + 1 on every change of the row (server-sent-event polling)
    runner_id TEXT,                         -- the runner holding a running job
    lease_until REAL                        -- ... until then, unless it renews the lease
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status, seq);
CREATE INDEX IF NOT EXISTS jobs_owner ON jobs (owner, seq);
"""

# version 1 -> 2: a job running in a version-1 file has no runner; its lease is over, so the first
# runner to start takes it back (as version 1 requeued every running job at start)
_MIGRATE_1_TO_2 = """
ALTER TABLE jobs ADD COLUMN runner_id TEXT;
ALTER TABLE jobs ADD COLUMN lease_until REAL;
UPDATE jobs SET lease_until = 0 WHERE status = 'running';
"""


class SqliteJobStore:
    """Jobs on disk (SQLite, WAL): survive a restart; every status change is one transaction.

    One connection per store, guarded by a lock (check_same_thread=False), rather than one per
    thread: every call is a short transaction (microseconds), so the lock costs nothing next to the
    jobs, and `close` can close the one connection from any thread (connections opened by worker
    threads could not be closed from the thread that shuts the service down). Between processes
    the file's own lock does the work: writes run in BEGIN IMMEDIATE transactions.
    """

    def __init__(self, path: Path, *, runner_id: str | None = None, lease_s: float = LEASE_S):
        self.path = Path(path)
        self.folder = self.path.parent
        self.runner_id = runner_id or default_runner_id()
        self.lease_s = lease_s
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                                       check_same_thread=False)
        except sqlite3.Error as e:
            raise JobStoreError(f"{self.path}: cannot open the job store ({e})") from None
        self._db.row_factory = sqlite3.Row
        try:
            self._open_schema()
        except BaseException:
            self._db.close()
            raise

    def _open_schema(self) -> None:
        """Create the schema in a new file, migrate an older one, refuse a newer one (in one
        transaction, so two processes opening a new file at once do not both create it)."""
        try:
            self._refuse_newer()  # before WAL: a newer store is left exactly as it is
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("BEGIN IMMEDIATE")
            try:
                found = self._refuse_newer()
                if found < SCHEMA_VERSION:
                    script = _MIGRATE_1_TO_2 if found == 1 else _SCHEMA
                    for statement in script.split(";"):
                        if statement.strip():
                            self._db.execute(statement)
                    self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        except sqlite3.Error as e:
            raise JobStoreError(f"{self.path}: not a usable job store ({e})") from None

    def _refuse_newer(self) -> int:
        found = self._db.execute("PRAGMA user_version").fetchone()[0]
        if found > SCHEMA_VERSION:
            raise JobStoreError(f"{self.path}: job store schema version {found} is newer than this "
                                f"lipstream reads ({SCHEMA_VERSION}); upgrade lipstream or use another file")
        return found

    # -- reads ---------------------------------------------------------------------------------

    def get(self, job_id: str, owner: str | None = None) -> Job | None:
        """The job, or None when there is none of that id or (owner given) it is someone else's:
        the service answers both with 404, so ids of other keys' jobs are not revealed."""
        with self._lock:
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None or (owner is not None and row["owner"] != owner):
            return None
        return job_from_row(row)

    def list(self, owner: str | None = None, limit: int = 100) -> list[Job]:
        """The newest `limit` jobs (of `owner` when given), newest first."""
        if limit <= 0:
            return []
        with self._lock:
            if owner is None:
                rows = self._db.execute("SELECT * FROM jobs ORDER BY seq DESC LIMIT ?", (limit,)).fetchall()
            else:
                rows = self._db.execute("SELECT * FROM jobs WHERE owner = ? ORDER BY seq DESC LIMIT ?",
                                        (owner, limit)).fetchall()
        return [job_from_row(row) for row in rows]

    def active(self, owner: str) -> int:
        """Queued + running jobs of `owner`: what a per-key cap counts."""
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM jobs WHERE owner = ? AND status IN (?, ?)",
                                    (owner, *ACTIVE_STATUSES)).fetchone()[0]

    def counts(self) -> dict[str, int]:
        """Jobs per status, every status present (0 when none), for /metrics."""
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        found = {status: n for status, n in rows}
        return {status: found.get(status, 0) for status in STATUSES}

    def version(self, job_id: str) -> int:
        """A number that changes whenever the job's row changes (one primary-key read, so an event
        stream can poll it every 100 ms and read the job only when it moved); 0 for no such job.
        A renewed lease is not a change a client sees: it leaves the version alone."""
        with self._lock:
            row = self._db.execute("SELECT version FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return 0 if row is None else row[0]

    # -- changes -------------------------------------------------------------------------------

    def submit(self, owner: str, kind: str, params: dict) -> Job:
        """A new queued job. ValueError for an unknown kind or parameters that are not a JSON object."""
        text = params_json(kind, params)
        with self._lock, self._transaction():
            row = self._db.execute(
                "INSERT INTO jobs (id, owner, kind, status, params, created_at) VALUES (?, ?, ?, 'queued', ?, ?)"
                " RETURNING *", (uuid.uuid4().hex, owner, kind, text, time.time())).fetchall()[0]
        return job_from_row(row)

    def claim_next(self, kinds: tuple[str, ...] | None = None) -> Job | None:
        """The oldest queued job (of `kinds`, when given) that no one asked to cancel, now running
        under this runner with a lease of lease_s and attempts + 1; None when there is none. Atomic
        across threads and processes: the select and the update are one statement in a BEGIN
        IMMEDIATE transaction."""
        if kinds is not None and not kinds:
            return None
        kind_filter, kind_args = ("", ()) if kinds is None else (
            f" AND kind IN ({', '.join('?' for _ in kinds)})", tuple(kinds))
        now = time.time()
        with self._lock, self._transaction():
            rows = self._db.execute(
                "UPDATE jobs SET status = 'running', started_at = ?, progress = 0, attempts = attempts + 1,"
                " runner_id = ?, lease_until = ?, version = version + 1 WHERE id = (SELECT id FROM jobs"
                f" WHERE status = 'queued' AND cancel_requested = 0{kind_filter} ORDER BY seq LIMIT 1) RETURNING *",
                (now, self.runner_id, now + self.lease_s, *kind_args)).fetchall()
        return job_from_row(rows[0]) if rows else None

    def renew(self, job_id: str) -> bool:
        """This runner's lease on a running job extended to now + lease_s (the runner's heartbeat);
        False when the job is no longer running under this runner (requeued after its lease
        expired, or finished): the runner must stop it without touching the store."""
        with self._lock, self._transaction():
            rows = self._db.execute("UPDATE jobs SET lease_until = ? WHERE id = ? AND status = 'running'"
                                    " AND runner_id = ? RETURNING id",
                                    (time.time() + self.lease_s, job_id, self.runner_id)).fetchall()
        return bool(rows)

    def set_progress(self, job_id: str, progress: float) -> None:
        """Progress of a job this runner holds, clamped to 0..1 (an unchanged value leaves the row,
        and so its version, alone). ValueError when the job is not running, or not under this
        runner: a runner whose job was requeued or cancelled under it finds out here."""
        progress = checked_progress(job_id, progress)
        with self._lock, self._transaction():
            row = self._db.execute("SELECT status, runner_id, progress FROM jobs WHERE id = ?", (job_id,)).fetchone()
            self._require(job_id, row, ("running",), "set progress")
            if row["progress"] != progress:
                self._db.execute("UPDATE jobs SET progress = ?, version = version + 1 WHERE id = ?",
                                 (progress, job_id))

    def finish(self, job_id: str, result: str) -> Job:
        """running -> done, with the output's path relative to the data folder (ValueError for an
        absolute path or one that climbs out with "..": the service serves files by this path)."""
        check_result(job_id, result)
        return self._move(job_id, "finish", "status = 'done', progress = 1, result = ?, finished_at = ?",
                          (result, time.time()))

    def fail(self, job_id: str, error: str) -> Job:
        """running -> failed, with the error as one line of at most 500 characters."""
        return self._move(job_id, "fail", "status = 'failed', error = ?, finished_at = ?",
                          (one_line(error), time.time()))

    def mark_cancelled(self, job_id: str) -> Job:
        """running -> cancelled: the runner stopped the job (after `cancel` asked it to)."""
        return self._move(job_id, "mark cancelled", "status = 'cancelled', finished_at = ?", (time.time(),))

    def cancel(self, job_id: str, owner: str | None = None) -> Job | None:
        """Ask for a job to stop: a queued one is cancelled at once; a running one gets
        cancel_requested (its runner stops it and calls `mark_cancelled`); a finished one is left
        as it is. None when there is no such job or (owner given) it is someone else's."""
        now = time.time()
        with self._lock, self._transaction():
            row = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None or (owner is not None and row["owner"] != owner):
                return None
            if row["status"] == "queued":
                row = self._db.execute("UPDATE jobs SET status = 'cancelled', finished_at = ?, version = version + 1"
                                       " WHERE id = ? RETURNING *", (now, job_id)).fetchall()[0]
            elif row["status"] == "running" and not row["cancel_requested"]:
                row = self._db.execute("UPDATE jobs SET cancel_requested = 1, version = version + 1"
                                       " WHERE id = ? RETURNING *", (job_id,)).fetchall()[0]
        return job_from_row(row)

    def requeue_running(self, *, max_attempts: int | None = None, shutdown: bool = False,
                        own: bool = True) -> list[str]:
        """Orphaned running jobs back to queued (progress 0, started_at and runner cleared), oldest
        first. Orphaned: its lease expired (its runner died), or (`own`) it is this runner's, which
        is starting or shutting down. A job of another runner whose lease still runs is left alone.

        With `max_attempts`: an orphan claimed that many times fails instead (it may be what
        brings a server down). On a graceful shutdown (`shutdown`) this runner's interrupted
        claims are not counted. An orphan someone asked to cancel is cancelled instead of run
        again (and not returned)."""
        now = time.time()
        orphan = "status = 'running' AND (lease_until IS NULL OR lease_until < ?" + (
            " OR runner_id = ?)" if own else ")")
        orphan_args = (now, self.runner_id) if own else (now,)
        with self._lock, self._transaction():
            if max_attempts is not None:
                self._db.execute(
                    "UPDATE jobs SET status = 'failed', finished_at = ?, error = ?, runner_id = NULL,"
                    f" lease_until = NULL, version = version + 1 WHERE {orphan} AND cancel_requested = 0"
                    " AND attempts >= ?", (now, crashed_error(max_attempts), *orphan_args, max_attempts))
            uncount = ", attempts = CASE WHEN runner_id = ? THEN MAX(0, attempts - 1) ELSE attempts END" \
                if shutdown else ""
            requeued = self._db.execute(
                f"UPDATE jobs SET status = 'queued', started_at = NULL, progress = 0{uncount}, runner_id = NULL,"
                f" lease_until = NULL, version = version + 1 WHERE {orphan} AND cancel_requested = 0"
                " RETURNING seq, id", ((self.runner_id,) if shutdown else ()) + orphan_args).fetchall()
            self._db.execute("UPDATE jobs SET status = 'cancelled', finished_at = ?, runner_id = NULL,"
                             f" lease_until = NULL, version = version + 1 WHERE {orphan} AND cancel_requested = 1",
                             (now, *orphan_args))
        return [row["id"] for row in sorted(requeued, key=lambda row: row["seq"])]

    def close(self) -> None:
        """Close the connection (the WAL is checkpointed into the file); calls after it fail."""
        with self._lock:
            self._db.close()

    # -- helpers -------------------------------------------------------------------------------

    def _move(self, job_id: str, action: str, assignments: str, args: tuple) -> Job:
        """One status change of a job this runner holds: update the row if it is running under this
        runner, else ValueError naming the job and why (the check and the update are one transaction)."""
        with self._lock, self._transaction():
            row = self._db.execute("SELECT status, runner_id FROM jobs WHERE id = ?", (job_id,)).fetchone()
            self._require(job_id, row, ("running",), action)
            row = self._db.execute(f"UPDATE jobs SET {assignments}, lease_until = NULL, version = version + 1"
                                   " WHERE id = ? RETURNING *", (*args, job_id)).fetchall()[0]
        return job_from_row(row)

    def _require(self, job_id: str, row: sqlite3.Row | None, allowed: tuple[str, ...], action: str) -> None:
        require_held(job_id, None if row is None else row["status"], None if row is None else row["runner_id"],
                     self.runner_id, allowed, action)

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, ROLLBACK on any exception: the write lock is taken up front, so
    a read-then-write never races another writer (and never fails half-way with SQLITE_BUSY).
    Statements with RETURNING are read with fetchall: SQLite will not commit while one is still
    being stepped. Some errors (a full disk: SQLITE_FULL) roll the transaction back themselves: the
    ROLLBACK is then left out, so the error raised is the one that happened, not "no transaction"."""

    def __init__(self, db: sqlite3.Connection):
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            try:
                self._db.execute("COMMIT")
                return
            except BaseException:
                self._rollback()
                raise
        self._rollback()

    def _rollback(self) -> None:
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")
