"""What `lipstream serve` allows and where it keeps things: one options object, checked at start."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

from lipstream.serve.store.base import LEASE_S, JobStoreError, default_runner_id

AVATAR_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a folder name, never a path
RETRY_AFTER_S = 5  # the Retry-After of a refusal for now (a key at its cap, a full engine, a server starting)
UPLOAD_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")  # a file name in the job's folder, never a path


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServeOptions:
    """`api_keys`: bearer keys a client must send (none: only on a loopback address).
    `max_upload_mb` and `max_audio_s` bound one upload; `jobs_per_key` bounds a key's queued and
    running jobs, `sessions_per_key` its live sessions. `max_attempts`: a job the server was running
    when it died that many times fails at the next start instead of running again. `playout_delay_s` (None: the preset's) is how far behind the speech sessions play: less
    latency at the client, more frames late when the engine is busy. `live_capacity_fps`: the frames/s live
    sessions may take in all (admission; None: what the engine measures at start, all of it).
    `switch_interval_ms`: the interpreter's GIL switch interval while the server runs. Every PyTorch op
    of the engine's core thread drops the GIL and must take it back from the process's other Python
    threads (the event loop, the frame copy-out); CPython makes the holder give it up only after this
    long (5 ms by default). `python -m lipstream.bench.gil_convoy`: beside one busy thread a
    62 ms eager Whisper call took 725 ms at 5 ms, 143 ms at 0.5 ms (traced: 129 and 71).
    `rtc_workers`: the processes aiortc runs in (serve/rtc.py), so that its Python holds their GILs, not
    the engine's. `database`: the job store (None: the SQLite file jobs.sqlite3 under `data_dir`; or
    postgresql://... shared by servers on several machines). `runner_id`: this server's name among
    those sharing the store (serve/store/base.py: leases), the same across its restarts. `lease_s`: how long
    a claim on a job lasts unless its runner renews it (every third of it): a dead server's job is
    taken by another this long after its last renewal. `job_poll_s`: how often an idle job runner looks
    at the store; a plain server's submit wakes its runner at once, but a fleet's replicas hear of a job
    only by looking (serve/fleet/replica.py asks FLEET_JOB_POLL_S)."""

    avatars_dir: Path
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    max_upload_mb: float = 50.0
    max_audio_s: float = 600.0
    jobs_per_key: int = 8
    sessions_per_key: int = 4
    max_attempts: int = 3
    live_preset: str = "realtime"
    live_capacity_fps: float | None = None
    playout_delay_s: float | None = None  # None: the preset's (realtime: 0.25 s)
    switch_interval_ms: float = 0.5
    rtc_workers: int | None = None  # WebRTC worker processes (None: one per 4 cores, 1 to 8)
    encode_workers: int | None = None  # live sessions' x264 worker processes (None: the cores less 2, at least 1)
    job_encoders: int | None = None  # render jobs' x264 segment encoders, processes from 2 (None: for the machine)
    database: str | None = None  # None: data_dir / "jobs.sqlite3"
    runner_id: str = field(default_factory=default_runner_id)
    lease_s: float = LEASE_S
    job_poll_s: float = 0.2

    def job_database(self) -> str | Path:
        return self.database or self.data_dir / "jobs.sqlite3"

    def check_database(self) -> None:
        """Open the job store once (a PostgreSQL server reached, the schema created or checked) and
        close it: one-line error naming --database before anything heavy loads."""
        try:
            from lipstream.serve.store.database import open_store  # psycopg only when it is asked for

            open_store(self.job_database(), runner_id=self.runner_id, lease_s=self.lease_s).close()
        except JobStoreError as e:
            raise ValueError(f"--database: {e}") from None

    def check(self) -> None:
        """One-line errors before anything loads."""
        if not self.avatars_dir.is_dir():
            raise ValueError(f"--avatars: {self.avatars_dir} is not a folder of compiled avatars")
        if not self.api_keys and not is_loopback(self.host):
            raise ValueError(f"--host {self.host}: without --api-key (or LIPSTREAM_API_KEYS) only a loopback "
                             "address is allowed")
        if any(len(k) < 16 for k in self.api_keys):
            raise ValueError("--api-key: keys of at least 16 characters are allowed")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port {self.port}: 0 to 65535 is allowed")
        if self.max_upload_mb <= 0 or self.max_audio_s <= 0 or self.jobs_per_key < 1 or self.sessions_per_key < 1:
            raise ValueError("upload and audio limits must be > 0, per-key caps >= 1")
        from lipstream.live.options import PRESETS

        if self.live_preset not in PRESETS:
            raise ValueError(f"--live-preset {self.live_preset!r}: one of {', '.join(PRESETS)} is allowed")
        if self.playout_delay_s is not None and not 0.05 <= self.playout_delay_s <= 5:
            raise ValueError(f"--playout-delay-ms {self.playout_delay_s * 1000:g}: 50 to 5000 is allowed")
        if not 0.1 <= self.switch_interval_ms <= 10:
            raise ValueError(f"--switch-interval-ms {self.switch_interval_ms:g}: 0.1 to 10 is allowed")
        if self.rtc_workers is not None and not 1 <= self.rtc_workers <= 64:
            raise ValueError(f"--rtc-workers {self.rtc_workers}: 1 to 64 is allowed")
        if self.encode_workers is not None and not 1 <= self.encode_workers <= 64:
            raise ValueError(f"--encode-workers {self.encode_workers}: 1 to 64 is allowed")
        if self.job_encoders is not None and not 1 <= self.job_encoders <= 64:
            raise ValueError(f"--job-encoders {self.job_encoders}: 1 to 64 is allowed")
        if not self.runner_id or len(self.runner_id) > 200:
            raise ValueError(f"--runner-id {self.runner_id!r}: a name of 1 to 200 characters is allowed")
        if not 0.1 <= self.lease_s <= 3600:
            raise ValueError(f"lease_s {self.lease_s:g}: 0.1 to 3600 s is allowed")
        if not 0.01 <= self.job_poll_s <= 10:
            raise ValueError(f"job_poll_s {self.job_poll_s:g}: 0.01 to 10 s is allowed")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts {self.max_attempts}: 1 or more is allowed")
