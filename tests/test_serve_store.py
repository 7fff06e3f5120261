"""The job store of `lipstream serve`: transitions, claims under contention, leases, restarts.

The same tests run on SQLite and on a real PostgreSQL server (started once for the session by
tests/postgres_server.py; skipped, with the reason, where its binaries are missing). No GPU."""

from __future__ import annotations

import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path

import pytest

from lipstream.errors import MissingExtra
from lipstream.serve.store.database import open_store
from lipstream.serve.store.base import SCHEMA_VERSION, Job, JobStore, JobStoreError
from postgres_server import PostgresServer, missing_reason


@pytest.fixture(scope="session")
def postgres_server():
    reason = missing_reason()
    if reason is not None:
        pytest.skip(f"no PostgreSQL server for the store tests: {reason}")
    server = PostgresServer().start()
    yield server
    server.stop()


class Database:
    """One empty database of a backend: open stores on it (as runners would), or read and write
    it behind the stores' backs (as another process, or another version, would)."""

    def __init__(self, backend: str, address: str | Path):
        self.backend, self.address = backend, address
        self.opened: list[JobStore] = []

    def open(self, runner_id: str = "runner-a", lease_s: float = 30.0) -> JobStore:
        store = open_store(self.address, runner_id=runner_id, lease_s=lease_s)
        self.opened.append(store)
        return store

    def raw(self, sql: str, *args) -> list[tuple]:
        """`sql` names the table {jobs} and takes ? arguments."""
        if self.backend == "sqlite":
            with closing(sqlite3.connect(self.address)) as raw, raw:
                return raw.execute(sql.format(jobs="jobs"), args).fetchall()
        import psycopg

        with psycopg.connect(self.address, autocommit=True) as raw:
            cursor = raw.execute(sql.format(jobs="lipstream_jobs").replace("?", "%s"), args)
            return cursor.fetchall() if cursor.description else []

    def close_all(self) -> None:
        for store in self.opened:
            try:
                store.close()
            except Exception:  # noqa: BLE001 - closed by the test already
                pass


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path: Path):
    if request.param == "sqlite":
        database = Database("sqlite", tmp_path / "jobs" / "jobs.db")
        yield database
        database.close_all()
        return
    server = request.getfixturevalue("postgres_server")
    url = server.new_database()
    database = Database("postgresql", url)
    yield database
    database.close_all()
    server.drop_database(url)


@pytest.fixture
def store(db: Database):
    return db.open()


def raw_sql(path: Path, sql: str, *args) -> list[tuple]:
    """Read or write a SQLite file behind the store's back."""
    with closing(sqlite3.connect(path)) as raw, raw:
        return raw.execute(sql, args).fetchall()


def running_job(store: JobStore, owner: str = "alice") -> Job:
    """A fresh job of `owner`, claimed (nothing else is queued in the tests that use it)."""
    job = store.submit(owner, "render", {"avatar": "anna"})
    claimed = store.claim_next()
    assert claimed is not None and claimed.id == job.id
    return claimed


def test_submit_get_list(db: Database, store: JobStore):
    first = store.submit("alice", "render", {"avatar": "anna", "audio": "a.wav", "fps": 25})
    second = store.submit("bob", "compile", {"video": "b.mp4"})
    third = store.submit("alice", "broadcast", {})
    if db.backend == "sqlite":
        assert store.folder == store.path.parent and store.path.parent.name == "jobs"
    assert first.status == "queued" and first.progress == 0 and first.attempts == 0
    assert first.result is None and first.error is None and not first.cancel_requested
    assert first.started_at is None and first.finished_at is None and first.created_at > 0
    assert len(first.id) == 32 and int(first.id, 16) >= 0

    assert store.get(first.id) == first
    assert store.get(first.id, owner="alice") == first
    assert store.get(first.id, owner="bob") is None  # someone else's job: as if there were none
    assert store.get("0" * 32) is None
    assert store.get(first.id).params == {"avatar": "anna", "audio": "a.wav", "fps": 25}

    assert [job.id for job in store.list()] == [third.id, second.id, first.id]
    assert [job.id for job in store.list(owner="alice")] == [third.id, first.id]
    assert [job.id for job in store.list(owner="carol")] == []
    assert [job.id for job in store.list(limit=2)] == [third.id, second.id]
    assert store.list(limit=0) == []


def test_submit_refuses_bad_input_and_stores_json(db: Database, store: JobStore):
    with pytest.raises(ValueError, match="kind"):
        store.submit("alice", "paint", {})
    with pytest.raises(ValueError, match="dict"):
        store.submit("alice", "render", ["not", "a", "dict"])
    with pytest.raises(ValueError, match="JSON"):
        store.submit("alice", "render", {"when": object()})
    job = store.submit("alice", "render", {"text": "héllo", "nested": {"a": [1, 2.5, None]}})
    [(params,)] = db.raw("SELECT params FROM {jobs} WHERE id = ?", job.id)
    assert isinstance(params, str) and '"nested"' in params  # JSON text, nothing pickled
    assert store.counts()["queued"] == 1  # the refused ones left nothing behind


def test_claim_oldest_first_and_by_kind(store: JobStore):
    ids = [store.submit("alice", kind, {"n": n}).id for n, kind in enumerate(["render", "compile", "render"])]
    compile_job = store.claim_next(kinds=("compile",))
    assert compile_job.id == ids[1] and compile_job.status == "running" and compile_job.attempts == 1
    assert compile_job.started_at is not None
    assert store.claim_next(kinds=("compile",)) is None
    assert store.claim_next(kinds=()) is None
    assert store.claim_next().id == ids[0]
    assert store.claim_next(kinds=("render", "broadcast")).id == ids[2]
    assert store.claim_next() is None


def _claim_concurrently(stores: list[JobStore], timeout_s: float) -> list[list[Job]]:
    """Four threads, two on each store, claim until the queue is empty, all starting at once: each
    thread's claims (thread k claims through stores[k % 2])."""
    start = threading.Barrier(4)
    claimed: list[list[Job]] = [[] for _ in range(4)]
    errors: list[BaseException] = []

    def claim_all(worker: int) -> None:
        try:
            start.wait()
            while (job := stores[worker % 2].claim_next()) is not None:
                claimed[worker].append(job)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=claim_all, args=(worker,)) for worker in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout_s)
    assert not errors
    return claimed


def test_concurrent_claims_take_each_job_once(db: Database):
    """4 threads over two stores on one database (as two processes would be): every job exactly once."""
    stores = [db.open(), db.open()]
    submitted = {stores[0].submit(f"owner{n % 3}", "render", {"n": n}).id for n in range(20)}
    claimed = _claim_concurrently(stores, timeout_s=30)
    every_claim = [job.id for worker in claimed for job in worker]
    assert len(every_claim) == 20 and set(every_claim) == submitted
    for job in stores[1].list():
        assert job.status == "running" and job.attempts == 1
    assert stores[1].counts()["running"] == 20
    for jobs in stores:
        jobs.close()


def test_progress_only_while_running(store: JobStore):
    queued = store.submit("alice", "render", {})
    with pytest.raises(ValueError, match=f"job {queued.id} is queued"):
        store.set_progress(queued.id, 0.5)
    job = store.claim_next()
    store.set_progress(job.id, 0.25)
    assert store.get(job.id).progress == 0.25
    store.set_progress(job.id, 1.5)  # rounding past the end: clamped
    assert store.get(job.id).progress == 1.0
    with pytest.raises(ValueError, match="NaN"):
        store.set_progress(job.id, float("nan"))
    store.finish(job.id, "out/a.mp4")
    with pytest.raises(ValueError, match="is done"):
        store.set_progress(job.id, 0.5)
    with pytest.raises(ValueError, match="no such job"):
        store.set_progress("f" * 32, 0.5)


def test_finish_and_fail(store: JobStore):
    job = running_job(store)
    done = store.finish(job.id, "outputs/render.mp4")
    assert done.status == "done" and done.result == "outputs/render.mp4" and done.progress == 1.0
    assert done.finished_at >= done.started_at and done.error is None

    failing = running_job(store)
    failed = store.fail(failing.id, "Traceback (most recent call last):\n  boom\n" + "x" * 1000)
    assert failed.status == "failed" and failed.result is None and failed.finished_at is not None
    assert "\n" not in failed.error and len(failed.error) <= 500
    assert failed.error.startswith("Traceback (most recent call last): boom x")

    for again in (lambda: store.finish(done.id, "b.mp4"), lambda: store.fail(done.id, "late"),
                  lambda: store.mark_cancelled(done.id)):
        with pytest.raises(ValueError, match=f"job {done.id} is done") as raised:
            again()
        assert "\n" not in str(raised.value)
    with pytest.raises(ValueError, match="is failed"):
        store.finish(failed.id, "c.mp4")

    queued = store.submit("alice", "render", {})
    for early in (lambda: store.finish(queued.id, "a.mp4"), lambda: store.fail(queued.id, "no"),
                  lambda: store.mark_cancelled(queued.id)):
        with pytest.raises(ValueError, match=f"job {queued.id} is queued, not running"):
            early()
    assert store.get(queued.id).status == "queued"  # a refused transition changes nothing


def test_finish_refuses_paths_outside_the_folder(store: JobStore):
    job = running_job(store)
    for outside in ("/etc/passwd", "../other/out.mp4", "out/../../x.mp4", ""):
        with pytest.raises(ValueError, match="inside the store's folder"):
            store.finish(job.id, outside)
    assert store.get(job.id).status == "running"


def test_cancel(store: JobStore):
    queued = store.submit("alice", "render", {})
    assert store.cancel(queued.id, owner="bob") is None  # not theirs
    assert store.cancel("0" * 32) is None
    cancelled = store.cancel(queued.id, owner="alice")
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None

    job = running_job(store)
    asked = store.cancel(job.id)
    assert asked.status == "running" and asked.cancel_requested
    assert store.cancel(job.id).cancel_requested  # asking twice changes nothing
    stopped = store.mark_cancelled(job.id)
    assert stopped.status == "cancelled" and stopped.finished_at is not None

    done = running_job(store)
    done = store.finish(done.id, "a.mp4")
    assert store.cancel(done.id) == done  # finished: left as it is
    assert store.cancel(cancelled.id) == store.get(cancelled.id)


def test_claim_skips_cancel_requested_jobs(db: Database, store: JobStore):
    """A queued job with cancel_requested (written by another process, or an older version) is
    never run; a running job asked to cancel is cancelled, not requeued, by requeue_running."""
    skipped = store.submit("alice", "render", {})
    later = store.submit("alice", "render", {})
    db.raw("UPDATE {jobs} SET cancel_requested = TRUE WHERE id = ?", skipped.id)
    assert store.claim_next().id == later.id
    assert store.claim_next() is None

    asked = running_job(store)
    store.cancel(asked.id)
    assert store.requeue_running() == [later.id]
    assert store.get(asked.id).status == "cancelled"
    assert store.claim_next().id == later.id  # the skipped one still is


def test_requeue_after_a_crash(db: Database):
    before = db.open()
    crashed = before.submit("alice", "render", {"n": 1})
    waiting = before.submit("alice", "render", {"n": 2})
    claimed = before.claim_next()
    assert claimed.id == crashed.id
    before.set_progress(crashed.id, 0.6)
    before.close()  # the process dies without finishing the job

    after = db.open()  # the same runner, restarted: its own running jobs are orphans at once
    assert after.get(crashed.id).status == "running"  # what the file says until start-up requeues it
    assert after.requeue_running() == [crashed.id]
    requeued = after.get(crashed.id)
    assert requeued.status == "queued" and requeued.progress == 0 and requeued.started_at is None
    assert requeued.attempts == 1 and requeued.params == {"n": 1}
    assert after.requeue_running() == []
    again = after.claim_next()
    assert again.id == crashed.id and again.attempts == 2  # still the oldest: runs before `waiting`
    assert after.get(waiting.id).status == "queued"
    after.close()


def test_version_changes_with_the_row_only(store: JobStore):
    job = store.submit("alice", "render", {})
    seen = [store.version(job.id)]

    def changed() -> None:
        seen.append(store.version(job.id))
        assert seen[-1] != seen[-2]

    def unchanged() -> None:
        assert store.version(job.id) == seen[-1]

    store.get(job.id), store.list(), store.counts(), store.active("alice")
    unchanged()
    store.claim_next()
    changed()
    store.set_progress(job.id, 0.5)
    changed()
    store.set_progress(job.id, 0.5)  # the same value: the row does not change
    unchanged()
    assert store.renew(job.id)  # a heartbeat is no change a client sees
    unchanged()
    store.cancel(job.id)
    changed()
    store.cancel(job.id)
    unchanged()
    store.finish(job.id, "a.mp4")
    changed()
    store.cancel(job.id)
    unchanged()
    with pytest.raises(ValueError):
        store.fail(job.id, "late")
    unchanged()
    other = store.submit("bob", "render", {})
    store.cancel(other.id)  # another job's changes
    unchanged()
    assert store.version("0" * 32) == 0


def test_counts_and_active(store: JobStore):
    assert store.counts() == {"queued": 0, "running": 0, "done": 0, "failed": 0, "cancelled": 0}
    for n in range(5):
        store.submit("alice" if n < 4 else "bob", "render", {"n": n})
    first = store.claim_next()
    second = store.claim_next()
    store.fail(second.id, "boom")
    store.cancel(store.claim_next().id)  # running, cancel requested: still active
    store.cancel(store.list(owner="alice")[0].id)  # the queued one: cancelled
    assert store.counts() == {"queued": 1, "running": 2, "done": 0, "failed": 1, "cancelled": 1}
    assert store.active("alice") == 2 and store.active("bob") == 1 and store.active("carol") == 0
    store.finish(first.id, "a.mp4")
    assert store.counts()["done"] == 1 and store.active("alice") == 1


def test_newer_store_refused(db: Database):
    newer = SCHEMA_VERSION + 1
    db.open().close()
    if db.backend == "sqlite":
        read, write = "PRAGMA user_version", f"PRAGMA user_version = {newer}"
    else:
        read, write = "SELECT version FROM lipstream_schema", f"UPDATE lipstream_schema SET version = {newer}"
    assert db.raw(read) == [(SCHEMA_VERSION,)]
    db.raw(write)
    with pytest.raises(JobStoreError, match=f"schema version {newer} is newer") as raised:
        db.open()
    assert "\n" not in str(raised.value)
    assert db.raw(read) == [(newer,)]  # refused, not touched


def test_not_a_database_refused(tmp_path: Path):
    path = tmp_path / "jobs.db"
    path.write_bytes(b"not sqlite at all " * 100)
    with pytest.raises(JobStoreError, match="not a usable job store") as raised:
        open_store(path)
    assert "\n" not in str(raised.value)


def test_a_job_running_at_every_crash_fails_after_max_attempts(db: Database):
    """A job that brings the server down is not run forever: at the third crash it fails, with why.
    A graceful shutdown's requeue does not count as an attempt."""
    job = db.open().submit("alice", "render", {"n": 1})
    for crash in (1, 2):
        store = db.open()
        assert store.requeue_running(max_attempts=3) == ([job.id] if crash > 1 else [])
        assert store.claim_next().attempts == crash
        store.close()  # dies mid-job
    store = db.open()
    assert store.requeue_running(max_attempts=3) == [job.id]
    assert store.claim_next().attempts == 3
    assert store.requeue_running(shutdown=True) == [job.id]  # SIGTERM: handed back, not counted
    assert store.get(job.id).attempts == 2
    assert store.claim_next().attempts == 3
    store.close()  # the third crash
    store = db.open()
    assert store.requeue_running(max_attempts=3) == []
    failed = store.get(job.id)
    assert failed.status == "failed" and "3 times" in failed.error and failed.finished_at is not None
    assert store.claim_next() is None


def test_two_runners_claiming_at_once_never_share_a_job(db: Database):
    """Two runners (two stores, two ids) with two threads each over 200 jobs: each job once, held by its claimer."""
    runners = [db.open("runner-a"), db.open("runner-b")]
    submitted = {runners[0].submit("alice", "render", {"n": n}).id for n in range(200)}
    claimed = _claim_concurrently(runners, timeout_s=60)
    every_claim = [job.id for worker in claimed for job in worker]
    assert len(every_claim) == 200 and set(every_claim) == submitted
    for worker, jobs in enumerate(claimed):
        assert all(job.runner_id == runners[worker % 2].runner_id for job in jobs)
    holders = {job.id: job.runner_id for job in runners[1].list(limit=200)}
    assert holders == {job.id: job.runner_id for worker in claimed for job in worker}  # as each claim said


def test_a_runner_whose_lease_expired_loses_its_job_to_the_other(db: Database):
    a, b = db.open("runner-a", lease_s=0.3), db.open("runner-b", lease_s=0.3)
    job = a.submit("alice", "render", {"n": 1})
    claimed = a.claim_next()
    assert claimed.runner_id == "runner-a" and claimed.lease_until > claimed.started_at
    for _ in range(4):  # a's heartbeat holds the job past its first lease
        time.sleep(0.1)
        assert a.renew(job.id)
        assert b.requeue_running(own=False) == []
    a.set_progress(job.id, 0.5)
    time.sleep(0.4)  # a stops renewing (it died, or lost the database)
    assert b.requeue_running(max_attempts=3, own=False) == [job.id]
    retaken = b.claim_next()
    assert retaken.id == job.id and retaken.runner_id == "runner-b" and retaken.attempts == 2
    assert retaken.progress == 0 and retaken.result is None
    assert not a.renew(job.id)  # a finds out at its next heartbeat...
    for late in (lambda: a.set_progress(job.id, 0.9), lambda: a.finish(job.id, "results/a.mp4"),
                 lambda: a.fail(job.id, "late"), lambda: a.mark_cancelled(job.id)):
        with pytest.raises(ValueError, match="held by runner 'runner-b'"):  # ...and can publish nothing
            late()
    assert b.get(job.id).result is None
    done = b.finish(job.id, "results/b.mp4")
    assert done.status == "done" and done.result == "results/b.mp4" and done.runner_id == "runner-b"
    assert a.get(job.id) == done


def test_a_start_takes_back_its_own_jobs_only(db: Database):
    """A restarted runner requeues its own running jobs at once; another's, whose lease runs, stay."""
    a, b = db.open("runner-a"), db.open("runner-b")
    mine = a.submit("alice", "render", {"n": 1})
    theirs = a.submit("alice", "render", {"n": 2})
    assert a.claim_next().id == mine.id and b.claim_next().id == theirs.id
    a.close()  # runner a dies
    restarted = db.open("runner-a")
    assert restarted.requeue_running(max_attempts=3) == [mine.id]
    assert restarted.get(theirs.id).status == "running" and restarted.get(theirs.id).runner_id == "runner-b"
    assert restarted.get(mine.id).runner_id is None and restarted.get(mine.id).lease_until is None
    b.claim_next()
    assert b.requeue_running(shutdown=True) == sorted([mine.id, theirs.id], key=[mine.id, theirs.id].index)
    assert b.get(theirs.id).attempts == 0 and b.get(mine.id).attempts == 1  # its own: handed back, not counted


def test_open_store_addresses(tmp_path: Path):
    for address in (tmp_path / "a.db", str(tmp_path / "b.db"), f"sqlite://{tmp_path / 'c.db'}"):
        store = open_store(address, runner_id="r")
        assert store.submit("alice", "render", {}).status == "queued"
        store.close()
    assert {p.name for p in tmp_path.iterdir()} >= {"a.db", "b.db", "c.db"}
    import importlib.util

    unreachable = ((JobStoreError, "cannot connect to PostgreSQL") if importlib.util.find_spec("psycopg") else
                   (MissingExtra, r"pip install 'lipstream\[postgres\]'"))
    for bad, (error, match) in (("mysql://u:secret@host/db", (JobStoreError, "not a job store address")),
                                ("sqlite://relative.db", (JobStoreError, "sqlite:///PATH")),
                                ("postgresql://u:secret@127.0.0.1:1/db", unreachable)):
        with pytest.raises(error, match=match) as raised:
            open_store(bad)
        assert "\n" not in str(raised.value) and "secret" not in str(raised.value)


V1_SCHEMA = """
CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, owner TEXT NOT NULL,
    kind TEXT NOT NULL, status TEXT NOT NULL, params TEXT NOT NULL, progress REAL NOT NULL DEFAULT 0,
    result TEXT, error TEXT, cancel_requested INTEGER NOT NULL DEFAULT 0, created_at REAL NOT NULL,
    started_at REAL, finished_at REAL, attempts INTEGER NOT NULL DEFAULT 0, version INTEGER NOT NULL DEFAULT 1);
CREATE INDEX jobs_status ON jobs (status, seq);
CREATE INDEX jobs_owner ON jobs (owner, seq);
INSERT INTO jobs (id, owner, kind, status, params, created_at, attempts, result, progress)
    VALUES ('d', 'alice', 'render', 'done', '{"n": 0}', 1.0, 1, 'results/d.mp4', 1);
INSERT INTO jobs (id, owner, kind, status, params, created_at, started_at, attempts, progress)
    VALUES ('r', 'alice', 'render', 'running', '{"n": 1}', 2.0, 3.0, 1, 0.4);
INSERT INTO jobs (id, owner, kind, status, params, created_at) VALUES ('q', 'bob', 'compile', 'queued', '{}', 4.0);
PRAGMA user_version = 1;
"""


def test_a_version_1_file_is_migrated(tmp_path: Path):
    """A file written by the one-runner store: columns added in place, jobs kept, its running job
    (a crash's, with no runner) requeued by whichever runner starts first."""
    path = tmp_path / "jobs.sqlite3"
    with closing(sqlite3.connect(path)) as raw:
        raw.executescript(V1_SCHEMA)
    store = open_store(path, runner_id="new-runner")
    assert raw_sql(path, "PRAGMA user_version") == [(SCHEMA_VERSION,)]
    columns = {row[1] for row in raw_sql(path, "PRAGMA table_info(jobs)")}
    assert {"runner_id", "lease_until"} <= columns
    assert store.get("d").result == "results/d.mp4" and store.get("d").status == "done"
    assert store.get("r").status == "running" and store.get("r").runner_id is None
    assert store.requeue_running(max_attempts=3, own=False) == ["r"]
    assert [store.claim_next().id for _ in range(2)] == ["r", "q"]
    assert store.get("r").attempts == 2 and store.get("r").runner_id == "new-runner"
    store.close()
    again = open_store(path, runner_id="new-runner")  # opening a migrated file changes nothing
    assert again.get("r").status == "running" and raw_sql(path, "PRAGMA user_version") == [(SCHEMA_VERSION,)]
    again.close()


def test_a_sqlite_store_on_a_full_disk_says_so_and_works_again_with_room(tmp_path: Path):
    """A write that finds the disk full raises SQLite's own "database or disk is full" (not a failed rollback
    hiding it), changes nothing, and the same store works once there is room (a small tmpfs, filled)."""
    import os
    import subprocess

    folder = tmp_path / "small"
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(folder)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({mounted.stderr.strip()})")
    try:
        store = open_store(folder / "jobs.db")
        job = running_job(store)
        filler = folder / "filler"
        with open(filler, "wb", buffering=0) as f, pytest.raises(OSError):
            while True:
                f.write(bytes(4096))
        with pytest.raises(sqlite3.OperationalError, match="disk is full"):
            store.submit("alice", "render", {"avatar": "anna", "pad": "x" * 8192})
        with pytest.raises(sqlite3.OperationalError, match="disk is full"):
            store.fail(job.id, "y" * 400)
        assert store.get(job.id).status == "running"
        filler.unlink()
        assert store.fail(job.id, "stopped").status == "failed"
        store.close()
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)
