"""One `lipstream serve` process: networks, live engine and avatars resident; jobs on disk.

Started once (every cache warm before it reports ready), then shared by the HTTP app's
requests: render jobs run through the live engine's offline lane, after the live sessions. It is
the ServerHost (serve/interface.py) of a single-process server, and the engine of each replica of
a fleet (serve/fleet/), whose front is the HTTP app instead.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from lipstream.avatar.cache import META
from lipstream.avatar.resident import resident_avatar
from lipstream.errors import LipStreamError
from lipstream.live import LiveEngine, preset
from lipstream.models import MuseTalk
from lipstream.serve.jobs import JobRunner
from lipstream.serve.store.database import open_store
from lipstream.serve.live import LiveSessions
from lipstream.serve.metrics import Metrics
from lipstream.serve.options import AVATAR_NAME, ServeOptions
from lipstream.serve.rtc import default_workers

if TYPE_CHECKING:
    from lipstream.avatar.trackers import Tracker
    from lipstream.engine.aot import CompiledNetworks
    from lipstream.serve.upgrade import StepsUpgrade
    from lipstream.engine.networks import PendingPackages

log = logging.getLogger(__name__)


class Service:
    """`session_prefix` begins every live session id (a fleet's replica: its name)."""

    def __init__(self, options: ServeOptions, models: MuseTalk, *, inductor: str = "off", session_prefix: str = "",
                 compiled: CompiledNetworks | None = None, pending: PendingPackages | None = None):
        """`pending`: packages to build after the start, then run on (serve/upgrade.py)."""
        self.o, self.models = options, models
        self.pending = pending
        self.upgrade: StepsUpgrade | None = None
        self.uploads_dir = options.data_dir / "uploads"
        self.results_dir = options.data_dir / "results"
        for d in (self.uploads_dir, self.results_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.store = open_store(options.job_database(), runner_id=options.runner_id, lease_s=options.lease_s)
        # sessions whose client takes H.264 send the engine's own video packets (encoded in its worker
        # processes, started with the engine); the others hand aiortc raw frames; the audio always goes
        # raw (serve/live.py says why)
        live_options = preset(options.live_preset).replace(encode=True, audio_codec="none",
                                                           capacity_fps=options.live_capacity_fps)
        if options.playout_delay_s is not None:
            live_options = live_options.replace(playout_delay_s=options.playout_delay_s)
        self.live = LiveEngine(models, live_options, inductor=inductor, compiled=compiled,
                               encode_processes=options.encode_workers)
        self.avatars: dict[str, int] = {}
        self._keysync = None  # model: keysync jobs' networks, loaded by the first
        self._tracker: Tracker | None = None  # compile jobs' face tracker, made by the first
        self.runner = JobRunner(self)
        self.metrics = Metrics(self.live, self.store, lambda: self.closed_late)
        self.closed_late = 0  # frames late in sessions already closed (for /metrics)
        self.sessions = LiveSessions(self, options.rtc_workers or default_workers(), session_prefix)
        self.ready = False
        self.start_phases: dict[str, float] = {}  # seconds of each step of start() (the "ready" event)
        self._stopped = False
        self._switch_interval: float | None = None
        self._frozen = False  # gc.freeze() at the end of start()

    def start(self) -> Service:
        """Load every avatar, capture and measure the steps, requeue what a crash of this server
        left running (and any job whose runner's lease expired)."""
        names = self.compiled_avatars()
        if not names:
            raise ValueError(f"--avatars: {self.o.avatars_dir} holds no compiled avatar")
        t = time.perf_counter()
        for name in names:
            self.add_avatar(name)
        self.start_phases = {"avatars_s": round(time.perf_counter() - t, 2)}
        self._switch_interval = sys.getswitchinterval()  # the process's, given back at stop
        sys.setswitchinterval(self.o.switch_interval_ms / 1000)
        self.live.start()
        self.start_phases.update(self.live.start_phases)
        requeued = self.store.requeue_running(max_attempts=self.o.max_attempts)
        if requeued:
            log.info("requeued after a restart: %d jobs that were running when this server stopped (or whose "
                     "runner's lease expired): %s", len(requeued), ", ".join(requeued))
        self._sweep()
        # what start made (networks, avatars, the libraries' modules) lives as long as the server: frozen,
        # a full collection no longer walks it (78 ms holding the GIL on a 2-core VM, the core thread with
        # it; a fleet's replica gets the same from Ray Serve)
        t = time.perf_counter()
        gc.collect()
        gc.freeze()
        self._frozen = True
        self.start_phases["gc_freeze_s"] = round(time.perf_counter() - t, 2)
        self.runner.start()
        self.ready = True
        self.metrics.ready.set(1)
        if self.pending is not None:
            from lipstream.serve.upgrade import StepsUpgrade

            self.upgrade = StepsUpgrade(self.live, self.pending, log_path=str(self.o.data_dir / "warmup.log")).start()
        return self

    def compiled_avatars(self) -> list[str]:
        return sorted(p.name for p in self.o.avatars_dir.iterdir() if (p / META).is_file()
                      and AVATAR_NAME.fullmatch(p.name))

    def add_new_avatars(self) -> list[str]:
        """Make resident what another server sharing --avatars compiled since this one started (a fleet's
        replica compiles a job's avatar; the others take it up here)."""
        added = [name for name in self.compiled_avatars() if name not in self.avatars]
        for name in added:
            self.add_avatar(name)
        return added

    def face_tracker(self) -> Tracker:
        """The compile jobs' face tracker (auto: DWPose, else dlib), made on the first job's thread and kept;
        a one-line error without the server's folders when it has none."""
        if self._tracker is None:
            from lipstream.avatar.trackers import choose_tracker, make_tracker

            m = self.models
            root = Path(m.source or ".")
            try:
                kind = choose_tracker("auto", root, m.random_weights)
            except LipStreamError:
                raise LipStreamError("this server has no face tracker for compile jobs: its operator can run "
                                     "`lipstream weights download` (DWPose) or install the dlib extra") from None
            self._tracker = make_tracker(kind, root, m.random_weights, m.config.name, m.device)
        return self._tracker

    def keysync_models(self):
        """KeySync for `model: keysync` jobs, loaded on the first one and kept: random like the server's networks
        (--random-weights), else from its models folder; a one-line error without the server's folders when
        the files are not there."""
        if self._keysync is None:
            from lipstream.keysync.load import load_keysync, random_keysync

            m = self.models
            if m.random_weights:
                self._keysync = random_keysync(m.config.name, m.device)
            else:
                try:
                    self._keysync = load_keysync(Path(m.source or "."), m.device)
                except LipStreamError:
                    raise LipStreamError("this server has no KeySync weights: its operator can run `lipstream weights "
                                         "download --model keysync`") from None
        return self._keysync

    def add_avatar(self, name: str) -> int:
        """Keep the compiled avatar --avatars/name resident (its idle loop too, once started)."""
        avatar = resident_avatar(self.o.avatars_dir / name, self.models.device,
                                 vae_fingerprint=self.models.fingerprints.get("vae"))
        index = self.avatars[name] = self.live.add_avatar(avatar)
        return index

    def _sweep(self) -> None:
        """Temporary files a killed server left behind (half uploads, half results). Servers sharing the
        store share the data folder: a half result (".JOBID....part") of a job that is running is being
        written by the runner holding it (this server's own were requeued just before), so it is kept."""
        for d in (self.uploads_dir, self.results_dir):
            for p in d.glob("*.part*"):
                if not self._being_written(p):
                    p.unlink(missing_ok=True)
        for p in self.results_dir.glob(".*"):
            if p.is_file() and not self._being_written(p):
                p.unlink(missing_ok=True)

    def _being_written(self, path) -> bool:
        job = self.store.get(path.name.lstrip(".").split(".", 1)[0])
        return job is not None and job.status == "running"

    def stop(self) -> None:
        """Graceful: stop taking work, this server's running job back to the queue, sessions closed. Once."""
        if self._stopped:
            return
        self._stopped = True
        self.ready = False
        self.metrics.ready.set(0)
        if self.upgrade is not None:
            self.upgrade.stop()
        self.runner.stop()
        requeued = self.store.requeue_running(shutdown=True)
        if requeued:
            log.info("requeued %d running jobs at shutdown", len(requeued))
        self.live.close()
        self.store.close()
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None
        if self._frozen:  # what this server froze may be collected again (a process that starts another)
            gc.unfreeze()
            self._frozen = False


    # the ServerHost interface (serve/interface.py): what the HTTP app needs of this server

    def is_ready(self) -> bool:
        return self.ready

    def failure(self) -> str | None:
        error = self.live.core.error
        if error is None:
            return None
        return f"the live engine's core stopped: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"

    def has_avatar(self, name: str) -> bool:
        return name in self.avatars

    def avatar_rows(self) -> list[dict]:
        out = []
        for name, index in sorted(self.avatars.items()):
            a = self.live.engine.avatars[index]
            out.append({"name": name, "width": a.size[0], "height": a.size[1], "fps": str(a.fps),
                        "loop_frames": a.num_frames})
        return out

    async def avatar_list(self) -> list[dict]:
        return self.avatar_rows()

    def wake_runner(self) -> None:
        self.runner.wake()

    def count_request(self, route: str, status: int) -> None:
        self.metrics.requests.labels(route, str(status)).inc()

    async def metrics_text(self) -> bytes:
        return self.metrics.text()

    async def start_serving(self) -> None:
        await self.sessions.start_workers()

    async def stop_serving(self) -> None:
        """SIGTERM: sessions closed, the running job requeued."""
        await self.sessions.close_all()
        await asyncio.to_thread(self.stop)
