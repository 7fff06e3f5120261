"""The PostgreSQL job store: one database that `lipstream serve` replicas on several machines share.

The same jobs, transitions and leases as the SQLite store (serve/store/base.py says how leases work),
in two tables of the given database (`lipstream_jobs`, `lipstream_schema`), so it can live beside
other applications' tables. Claims take the oldest queued row with SELECT ... FOR UPDATE SKIP
LOCKED: concurrent claimers never wait on each other and never take the same row. Every other
read-then-write locks its row (FOR UPDATE) for its transaction. Timestamps and leases are the
database's clock (clock_timestamp()), so the replicas' clocks need not agree.

One connection per store, guarded by a lock, as in the SQLite store; a connection that broke (the
server restarted) is opened again at the next call, and the call that found it broken fails.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from lipstream.errors import require
from lipstream.serve.store.base import (ACTIVE_STATUSES, LEASE_S, SCHEMA_VERSION, STATUSES, Job, JobStoreError,
    check_result, checked_progress, crashed_error, default_runner_id, job_from_row, one_line, params_json, redact,
    require_held)

CONNECT_TIMEOUT_S = 5
NOW = "extract(epoch from clock_timestamp())::double precision"
SCHEMA_LOCK = 0x6C697073  # pg_advisory_xact_lock key: replicas starting together create the tables once

_SCHEMA = """
CREATE TABLE IF NOT EXISTS lipstream_schema (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS lipstream_jobs (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,  -- submission order
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    params TEXT NOT NULL,                                 -- JSON text, as written
    progress DOUBLE PRECISION NOT NULL DEFAULT 0,
    result TEXT,
    error TEXT,
    cancel_requested BOOLEAN NOT NULL DEFAULT FALSE,
    created_at DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION,
    finished_at DOUBLE PRECISION,
    attempts INTEGER NOT NULL DEFAULT 0,
    version INTEGER NOT NULL DEFAULT 1,                   -- + 1 on every change a client sees
    runner_id TEXT,
    lease_until DOUBLE PRECISION
);
CREATE INDEX IF NOT EXISTS lipstream_jobs_status ON lipstream_jobs (status, seq);
CREATE INDEX IF NOT EXISTS lipstream_jobs_owner ON lipstream_jobs (owner, seq)
"""


class PostgresJobStore:
    """Jobs in a PostgreSQL database shared by several runners (see the module's docstring)."""

    def __init__(self, url: str, *, runner_id: str | None = None, lease_s: float = LEASE_S):
        self.url = url
        self.runner_id = runner_id or default_runner_id()
        self.lease_s = lease_s
        self._lock = threading.Lock()
        self._db = self._connect()
        try:
            self._open_schema()
        except BaseException:
            self._db.close()
            raise

    def _connect(self):
        require("postgres", "the PostgreSQL job store", "psycopg")
        import psycopg
        from psycopg.rows import dict_row

        try:
            return psycopg.connect(self.url, autocommit=True, row_factory=dict_row,
                                   connect_timeout=CONNECT_TIMEOUT_S)
        except psycopg.Error as e:
            raise JobStoreError(f"{redact(self.url)}: cannot connect to PostgreSQL ({_first_line(e)})") from None

    def _open_schema(self) -> None:
        """Create the tables in a new database, refuse one written by a newer lipstream."""
        import psycopg

        try:
            with self._db.transaction():
                self._db.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
                self._db.execute("CREATE TABLE IF NOT EXISTS lipstream_schema (version INTEGER NOT NULL)")
                row = self._db.execute("SELECT max(version) AS version FROM lipstream_schema").fetchone()
                found = row["version"] or 0
                if found > SCHEMA_VERSION:
                    raise JobStoreError(f"{redact(self.url)}: job store schema version {found} is newer than this "
                                        f"lipstream reads ({SCHEMA_VERSION}); upgrade lipstream or use another database")
                if found < SCHEMA_VERSION:  # the first PostgreSQL store is version 2: nothing older to migrate
                    for statement in _SCHEMA.split(";"):
                        self._db.execute(statement)
                    self._db.execute("DELETE FROM lipstream_schema")
                    self._db.execute("INSERT INTO lipstream_schema (version) VALUES (%s)", (SCHEMA_VERSION,))
        except psycopg.Error as e:
            raise JobStoreError(f"{redact(self.url)}: not a usable job store ({_first_line(e)})") from None

    # -- reads ---------------------------------------------------------------------------------

    def get(self, job_id: str, owner: str | None = None) -> Job | None:
        """The job, or None when there is none of that id or (owner given) it is someone else's."""
        with self._transaction() as db:
            row = db.execute("SELECT * FROM lipstream_jobs WHERE id = %s", (job_id,)).fetchone()
        if row is None or (owner is not None and row["owner"] != owner):
            return None
        return job_from_row(row)

    def list(self, owner: str | None = None, limit: int = 100) -> list[Job]:
        """The newest `limit` jobs (of `owner` when given), newest first."""
        if limit <= 0:
            return []
        with self._transaction() as db:
            if owner is None:
                rows = db.execute("SELECT * FROM lipstream_jobs ORDER BY seq DESC LIMIT %s", (limit,)).fetchall()
            else:
                rows = db.execute("SELECT * FROM lipstream_jobs WHERE owner = %s ORDER BY seq DESC LIMIT %s",
                                  (owner, limit)).fetchall()
        return [job_from_row(row) for row in rows]

    def active(self, owner: str) -> int:
        """Queued + running jobs of `owner`: what a per-key cap counts."""
        with self._transaction() as db:
            return db.execute("SELECT count(*) AS n FROM lipstream_jobs WHERE owner = %s AND status = ANY(%s)",
                              (owner, list(ACTIVE_STATUSES))).fetchone()["n"]

    def counts(self) -> dict[str, int]:
        """Jobs per status, every status present (0 when none), for /metrics."""
        with self._transaction() as db:
            rows = db.execute("SELECT status, count(*) AS n FROM lipstream_jobs GROUP BY status").fetchall()
        found = {row["status"]: row["n"] for row in rows}
        return {status: found.get(status, 0) for status in STATUSES}

    def version(self, job_id: str) -> int:
        """A number that changes whenever the job's row changes as a client sees it; 0 for no such job."""
        with self._transaction() as db:
            row = db.execute("SELECT version FROM lipstream_jobs WHERE id = %s", (job_id,)).fetchone()
        return 0 if row is None else row["version"]

    # -- changes -------------------------------------------------------------------------------

    def submit(self, owner: str, kind: str, params: dict) -> Job:
        """A new queued job. ValueError for an unknown kind or parameters that are not a JSON object."""
        text = params_json(kind, params)
        with self._transaction() as db:
            row = db.execute("INSERT INTO lipstream_jobs (id, owner, kind, status, params, created_at)"
                             f" VALUES (%s, %s, %s, 'queued', %s, {NOW}) RETURNING *",
                             (uuid.uuid4().hex, owner, kind, text)).fetchone()
        return job_from_row(row)

    def claim_next(self, kinds: tuple[str, ...] | None = None) -> Job | None:
        """The oldest queued job (of `kinds`, when given) that no one asked to cancel, now running
        under this runner with a lease of lease_s; None when there is none. SKIP LOCKED: a row
        another runner is claiming right now is passed over, not waited for nor taken twice."""
        if kinds is not None and not kinds:
            return None
        kind_filter, kind_args = ("", ()) if kinds is None else (" AND kind = ANY(%s)", (list(kinds),))
        with self._transaction() as db:
            row = db.execute(
                f"UPDATE lipstream_jobs SET status = 'running', started_at = {NOW}, progress = 0,"
                f" attempts = attempts + 1, runner_id = %s, lease_until = {NOW} + %s, version = version + 1"
                " WHERE id = (SELECT id FROM lipstream_jobs WHERE status = 'queued' AND NOT cancel_requested"
                f"{kind_filter} ORDER BY seq LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING *",
                (self.runner_id, self.lease_s, *kind_args)).fetchone()
        return None if row is None else job_from_row(row)

    def renew(self, job_id: str) -> bool:
        """This runner's lease extended to now + lease_s; False when it no longer holds the job."""
        with self._transaction() as db:
            row = db.execute(f"UPDATE lipstream_jobs SET lease_until = {NOW} + %s WHERE id = %s"
                             " AND status = 'running' AND runner_id = %s RETURNING id",
                             (self.lease_s, job_id, self.runner_id)).fetchone()
        return row is not None

    def set_progress(self, job_id: str, progress: float) -> None:
        """Progress of a job this runner holds, clamped to 0..1 (an unchanged value changes nothing)."""
        progress = checked_progress(job_id, progress)
        with self._transaction() as db:
            row = db.execute("SELECT status, runner_id, progress FROM lipstream_jobs WHERE id = %s FOR UPDATE",
                             (job_id,)).fetchone()
            self._require(job_id, row, "set progress")
            if row["progress"] != progress:
                db.execute("UPDATE lipstream_jobs SET progress = %s, version = version + 1 WHERE id = %s",
                           (progress, job_id))

    def finish(self, job_id: str, result: str) -> Job:
        """running -> done, with the output's path relative to the data folder."""
        check_result(job_id, result)
        return self._move(job_id, "finish", "status = 'done', progress = 1, result = %s", (result,))

    def fail(self, job_id: str, error: str) -> Job:
        """running -> failed, with the error as one line of at most 500 characters."""
        return self._move(job_id, "fail", "status = 'failed', error = %s", (one_line(error),))

    def mark_cancelled(self, job_id: str) -> Job:
        """running -> cancelled: the runner stopped the job (after `cancel` asked it to)."""
        return self._move(job_id, "mark cancelled", "status = 'cancelled'", ())

    def cancel(self, job_id: str, owner: str | None = None) -> Job | None:
        """Ask for a job to stop (see SqliteJobStore.cancel); any server may."""
        with self._transaction() as db:
            row = db.execute("SELECT * FROM lipstream_jobs WHERE id = %s FOR UPDATE", (job_id,)).fetchone()
            if row is None or (owner is not None and row["owner"] != owner):
                return None
            if row["status"] == "queued":
                row = db.execute(f"UPDATE lipstream_jobs SET status = 'cancelled', finished_at = {NOW},"
                                 " version = version + 1 WHERE id = %s RETURNING *", (job_id,)).fetchone()
            elif row["status"] == "running" and not row["cancel_requested"]:
                row = db.execute("UPDATE lipstream_jobs SET cancel_requested = TRUE, version = version + 1"
                                 " WHERE id = %s RETURNING *", (job_id,)).fetchone()
        return job_from_row(row)

    def requeue_running(self, *, max_attempts: int | None = None, shutdown: bool = False,
                        own: bool = True) -> list[str]:
        """Orphaned running jobs back to queued, oldest first (see SqliteJobStore.requeue_running).
        Two runners requeueing at once do not both requeue a job: an UPDATE re-reads a row another
        transaction changed under it, and a job no longer running is passed over."""
        orphan = f"status = 'running' AND (lease_until IS NULL OR lease_until < {NOW}" + (
            " OR runner_id = %s)" if own else ")")
        orphan_args = (self.runner_id,) if own else ()
        clear = "runner_id = NULL, lease_until = NULL, version = version + 1"
        with self._transaction() as db:
            if max_attempts is not None:
                db.execute(f"UPDATE lipstream_jobs SET status = 'failed', finished_at = {NOW}, error = %s, {clear}"
                           f" WHERE {orphan} AND NOT cancel_requested AND attempts >= %s",
                           (crashed_error(max_attempts), *orphan_args, max_attempts))
            uncount = ", attempts = CASE WHEN runner_id = %s THEN greatest(0, attempts - 1) ELSE attempts END" \
                if shutdown else ""
            requeued = db.execute(
                f"UPDATE lipstream_jobs SET status = 'queued', started_at = NULL, progress = 0{uncount}, {clear}"
                f" WHERE {orphan} AND NOT cancel_requested RETURNING seq, id",
                ((self.runner_id,) if shutdown else ()) + orphan_args).fetchall()
            db.execute(f"UPDATE lipstream_jobs SET status = 'cancelled', finished_at = {NOW}, {clear}"
                       f" WHERE {orphan} AND cancel_requested", orphan_args)
        return [row["id"] for row in sorted(requeued, key=lambda row: row["seq"])]

    def close(self) -> None:
        """Close the connection; calls after it fail."""
        with self._lock:
            self._db.close()

    # -- helpers -------------------------------------------------------------------------------

    def _move(self, job_id: str, action: str, assignments: str, args: tuple) -> Job:
        """One status change of a job this runner holds (the check and the update are one transaction,
        the row locked between them)."""
        with self._transaction() as db:
            row = db.execute("SELECT status, runner_id FROM lipstream_jobs WHERE id = %s FOR UPDATE",
                             (job_id,)).fetchone()
            self._require(job_id, row, action)
            row = db.execute(f"UPDATE lipstream_jobs SET {assignments}, finished_at = {NOW}, lease_until = NULL,"
                             " version = version + 1 WHERE id = %s RETURNING *", (*args, job_id)).fetchone()
        return job_from_row(row)

    def _require(self, job_id: str, row: dict | None, action: str) -> None:
        require_held(job_id, None if row is None else row["status"], None if row is None else row["runner_id"],
                     self.runner_id, ("running",), action)

    @contextmanager
    def _transaction(self) -> Iterator:
        """The connection, under the store's lock, in one transaction (committed at the end, rolled
        back on any exception); opened again first when the last one broke."""
        import psycopg

        with self._lock:
            if self._db.closed and not self._db.broken:
                raise JobStoreError(f"{redact(self.url)}: the job store is closed")
            if self._db.broken:
                self._db = self._connect()
            try:
                with self._db.transaction():
                    yield self._db
            except psycopg.OperationalError as e:
                raise JobStoreError(f"{redact(self.url)}: PostgreSQL failed ({_first_line(e)})") from None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
