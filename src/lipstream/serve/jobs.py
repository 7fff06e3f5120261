"""The job runner: queued jobs, one at a time. Render and broadcast jobs go through the live
engine's offline lane; a compile job makes a new resident avatar.

A job's frames go through the same scheduler as the live sessions, after theirs
(live/offline.py), and its MP4 is written the way `lipstream render` (or `broadcast`) writes one:
render_program, a temporary name, renamed when complete. On shutdown the running job stops at its next batch and
goes back to the queue; a restart runs it again from the start. Nothing half-written is kept.

Several runners (servers) may share one store: while a job runs, a heartbeat thread renews its
lease; a runner whose lease was lost (it stalled, or lost the database, and another requeued the
job) stops the job at its next batch and leaves the store alone. An idle runner requeues jobs
whose lease expired (their server died), so another server finishes them.

A job out of memory (the GPU's or the host's) or out of disk space while its result is written fails
with one line saying so; the runner goes on to the next job, and the live sessions, whose steps are
sized at start, play on. A store that cannot be written for a moment (a full disk, a database away)
does not end the runner: the job's lease runs out and it is run again.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from lipstream.faults import inject
from lipstream.heap import give_back_heap
from lipstream.live.offline import JobCancelled, OfflineLane
from lipstream.render.script import single_scene
from lipstream.serve.private_paths import server_folders, without_server_paths

if TYPE_CHECKING:
    from lipstream.live import LiveEngine
    from lipstream.models import MuseTalk
    from lipstream.serve.metrics import Metrics
    from lipstream.serve.options import ServeOptions
    from lipstream.serve.store.base import Job, JobStore

log = logging.getLogger(__name__)
KINDS = ("render", "broadcast", "compile")
PROGRESS_EVERY_S = 0.25  # progress is written to the store at most this often
REQUEUE_EVERY_S = 5.0  # how often an idle runner looks for jobs whose runner died (expired leases)
STORE_RETRY_S = 1.0  # how long the runner waits after the store refused a write (a full disk, a database away)


class JobStopped(JobCancelled):
    """The server is shutting down: the job goes back to the queue."""


class JobLost(JobCancelled):
    """This runner's lease on the job was lost and the job requeued: another runner runs it now."""


class JobHost(Protocol):
    """What the runner uses of the server it runs in (serve/service.py's Service is one): declared
    here so that the runner does not import the Service that starts it."""

    o: ServeOptions
    models: MuseTalk
    live: LiveEngine
    store: JobStore
    metrics: Metrics
    results_dir: Path

    def add_avatar(self, name: str) -> int: ...

    def add_new_avatars(self) -> list[str]: ...


class JobRunner:
    def __init__(self, host: JobHost):
        self.s = host
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._killed = threading.Event()  # kill(): heartbeat dead, worker halted
        self._unfrozen = threading.Event()  # unfreeze(): the halted worker goes on
        self._thread: threading.Thread | None = None
        self.running: str | None = None  # the job id being rendered

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="lipstream-jobs", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop at the running job's next batch (it is requeued) and end the thread."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def kill(self) -> None:
        """What a crashed server amounts to, for tests of several runners on one store in one process: the
        heartbeat stops renewing at once, the worker halts at its running job's next batch and the runner
        claims nothing more. The store is left as it is (nothing finished, failed or requeued): another
        runner requeues the job once its lease has expired."""
        self._killed.set()
        self._wake.set()

    def unfreeze(self) -> None:
        """After `kill`: the halted worker goes on, its heartbeat still dead, as a server that froze
        (SIGSTOP, a stalled disk or network) and came back after its lease expired would. Whatever it
        tries then, the store refuses (the job is another runner's): its first progress write stops it."""
        self._unfrozen.set()

    def _loop(self) -> None:
        last_requeue = time.monotonic()
        while not self._stopping.is_set() and not self._killed.is_set():
            # a short lease is looked after as often as it needs (half of it), a long one every REQUEUE_EVERY_S
            if time.monotonic() - last_requeue >= min(REQUEUE_EVERY_S, self.s.store.lease_s / 2):
                last_requeue = time.monotonic()
                self._requeue_expired()
                self._add_new_avatars()
            if self.s.live.failed():  # the engine stopped: the queue waits for a restart (or another server)
                self._stopping.wait(self.s.o.job_poll_s)
                continue
            try:
                job = self.s.store.claim_next(KINDS)
                if job is None:
                    self._wake.wait(self.s.o.job_poll_s)  # a submit in this process wakes it at once
                    self._wake.clear()
                    continue
                self.running = job.id
                try:
                    self._run(job)
                finally:
                    self.running = None
            except Exception:  # noqa: BLE001 (the store could not be written: a job it holds runs again once
                # its lease runs out; the runner lives on)
                log.exception("the job store refused a change; trying again")
                self._stopping.wait(STORE_RETRY_S)

    def _requeue_expired(self) -> None:
        try:
            requeued = self.s.store.requeue_running(max_attempts=self.s.o.max_attempts, own=False)
        except Exception:  # noqa: BLE001 (the database is away: the next round tries again)
            log.exception("could not requeue jobs whose lease expired")
            return
        if requeued:
            log.info("requeued %d jobs whose runner stopped renewing their lease", len(requeued))

    def _add_new_avatars(self) -> None:
        try:
            added = self.s.add_new_avatars()
        except Exception:  # noqa: BLE001 (a half-copied folder, say: the next round tries again)
            log.exception("could not load the avatars compiled elsewhere")
            return
        if added:
            log.info("resident now: %s (compiled by another server)", ", ".join(added))

    def _heartbeat(self, job_id: str, done: threading.Event, lost: threading.Event) -> None:
        """Renew the job's lease every third of it until the job ends; `lost` when it is no longer ours."""
        while not done.wait(self.s.store.lease_s / 3):
            if self._killed.is_set():
                return  # dead: the lease runs out
            try:
                if not self.s.store.renew(job_id):
                    lost.set()
                    return
            except Exception:  # noqa: BLE001 (the database is away: the lease may still be renewed in time)
                log.warning("job %s: could not renew its lease", job_id, exc_info=True)

    def _run(self, job: Job) -> None:
        done, lost = threading.Event(), threading.Event()
        heartbeat = threading.Thread(target=self._heartbeat, args=(job.id, done, lost),
                                     name="lipstream-job-lease", daemon=True)
        heartbeat.start()
        try:
            self._run_held(job, lost)
        except ValueError as e:  # the store refused a change: the job is no longer this runner's
            if not lost.is_set() and self.s.store.renew(job.id):
                raise
            log.warning("job %s: lost to another runner (%s)", job.id, e)
        finally:
            done.set()
            heartbeat.join()

    def _run_held(self, job: Job, lost: threading.Event) -> None:
        store, t0 = self.s.store, time.monotonic()
        last = [0.0]

        def cancelled() -> bool:  # asked before each batch of the job's frames
            inject("job")
            while self._killed.is_set() and not self._unfrozen.is_set() and not self._stopping.is_set():
                self._unfrozen.wait(0.05)  # killed: halted here
            if self._stopping.is_set():
                raise JobStopped("the server is shutting down")
            if lost.is_set():
                raise JobLost("this runner's lease expired; another runner has the job")
            current = store.get(job.id)
            return current is None or current.cancel_requested

        def progress(done: int, total: int) -> None:
            now = time.monotonic()
            if now - last[0] >= PROGRESS_EVERY_S or done == total:
                last[0] = now
                store.set_progress(job.id, done / max(1, total))

        result = self.s.results_dir / f"{job.id}.mp4"
        try:
            if job.kind == "compile":
                result = self.compile(job.params)
            else:
                self.render(job.kind, job.params, result, cancelled, progress)
        except JobStopped:
            log.info("job %s: stopped by the shutdown; queued again", job.id)
            return  # still "running" in the store: the shutdown requeues it
        except JobLost as e:
            log.warning("job %s: stopped: %s", job.id, e)
            return
        except JobCancelled:
            store.mark_cancelled(job.id)
            log.info("job %s: cancelled", job.id)
            return
        except Exception as e:  # noqa: BLE001 (a failed job is reported, the server goes on)
            if lost.is_set() or not store.renew(job.id):
                log.warning("job %s: stopped (%s); another runner has it", job.id, e)
                return
            log.exception("job %s failed", job.id)
            # what the client reads: one line, none of the server's folders (a file by the name it was sent)
            store.fail(job.id, without_server_paths(job_error(e), server_folders(self.s.o)))
            return
        store.finish(job.id, os.path.relpath(result, self.s.o.data_dir) if job.kind != "compile"
                     else f"avatars/{job.params['name']}")
        self.s.metrics.job_seconds.observe(time.monotonic() - t0)
        log.info("job %s: done in %.1f s", job.id, time.monotonic() - t0)
        give_back_heap()

    def render(self, kind: str, params: dict, output: Path, cancelled, progress) -> None:
        """A render job ({"avatar": name, "audio": path under the data folder}) or a broadcast job
        ({"script": path of its YAML, beside its audio files}); either may hold the output options a
        local render takes (routes_jobs.OUTPUT_OPTIONS: fps, crf, x264_preset; a render's start_frame)."""
        from fractions import Fraction

        from lipstream.render.options import RenderOptions
        from lipstream.render.program import render_program
        from lipstream.render.script import load_script, scene_models

        if kind == "broadcast":
            program = load_script(self.s.o.data_dir / params["script"])
        else:
            program = single_scene(params["avatar"], self.s.o.data_dir / params["audio"], params.get("start_frame", 0))
        # the batches are the live engine's: its largest step; x264 and encoders chosen for the machine
        # unless the job says otherwise
        encoders = self.s.o.job_encoders  # --job-encoders: so many, in processes from 2
        options = RenderOptions(avatars_dir=self.s.o.avatars_dir, progress=False,
                                fps=Fraction(params["fps"]) if "fps" in params else None, crf=params.get("crf", 18),
                                x264_preset=params.get("x264_preset"), encoders=encoders,
                                encoder_processes=None if encoders is None else encoders > 1)
        model = params.get("model", "musetalk")
        if "keysync" in scene_models(program, model):  # on the same GPU, beside the live sessions
            from lipstream.keysync.render import render_keysync

            def check() -> None:  # the live engine's lane asks before each batch; KeySync between UNet calls
                if cancelled():
                    raise JobCancelled("the job was cancelled")

            render_keysync(program, output, self.s.keysync_models(), options, default=model, musetalk=self.s.models,
                           musetalk_engine=OfflineLane(self.s.live, cancelled), on_progress=progress, check=check)
            return
        render_program(program, output, self.s.models, options, engine=OfflineLane(self.s.live, cancelled),
                       on_progress=progress)

    def compile(self, params: dict) -> Path:
        """A compile job ({"name": new avatar, "video": path}): compiled into --avatars, then resident."""
        from lipstream.avatar import compile_avatar

        m = self.s.models
        video = self.s.o.data_dir / params["video"]
        compile_avatar(video, self.s.o.avatars_dir, m.vae, m.fingerprints["vae"], progress=False,
                       tracker=self.s.face_tracker(), vae_random=m.config.name if m.random_weights else None)
        self.s.add_avatar(params["name"])
        return self.s.o.avatars_dir / params["name"]


def job_error(e: BaseException) -> str:
    """A failed job's one line: out of memory and a full disk said as such (with what to do), and never
    with the server's paths; anything else as its type and first line."""
    if is_out_of_memory(e):
        import torch

        gpu = isinstance(e, torch.cuda.OutOfMemoryError) or "CUDA" in str(e)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # the failed job's blocks back to the GPU for the next job
        detail = str(e).splitlines()[0].split(". ", 2)
        return (f"out of {'GPU ' if gpu else ''}memory while rendering: {'. '.join(detail[:2])[:200]}; try a "
                "shorter job, or again when fewer live sessions and jobs run")
    if is_disk_full(e):
        return "disk full writing the result (the server's data folder has no space left); try again once there is room"
    return f"{type(e).__name__}: {e}".splitlines()[0]


def _chain(e: BaseException | None):
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def is_out_of_memory(e: BaseException) -> bool:
    """An allocation that failed: CUDA's OutOfMemoryError (a RuntimeError saying "out of memory" in older
    torch) or the host's MemoryError, raised itself or on the way."""
    return any(isinstance(x, MemoryError) or (isinstance(x, RuntimeError) and "out of memory" in str(x))
               for x in _chain(e))


def is_disk_full(e: BaseException) -> bool:
    """A write that found no space (ENOSPC) or no quota (EDQUOT) left, raised itself or on the way (PyAV's
    and the encoders' errors carry the errno)."""
    return any(isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT) for x in _chain(e))
