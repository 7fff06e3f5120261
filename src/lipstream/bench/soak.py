"""`lipstream serve-bench --soak MINUTES`: hours of uptime of a running `lipstream serve`, and nothing grows.

A churn of live sessions (K at a time; each opens over WebRTC, speaks a few seconds, waits for its
last frames and closes: `lipstream.client.connect`, all in this process's event loop, so a client
costs little and closes cleanly) and render jobs arriving every N seconds, for MINUTES. Every
`sample_s` the server is sampled between sessions and jobs (new ones wait while the open ones end):
from /proc (given its process id) its resident memory, open files and threads, and its child
processes' (the WebRTC and encode workers) by kind; from its /metrics the GPU memory (allocated and
reserved), frames played late so far, open sessions and jobs. The report cuts a warm-up (the first
fifth of the samples), then gives each series' first value after it, its last, its max, the drift in %
(last against first) and a least-squares slope per hour, each passing when the drift is within 5 %;
late frames per minute over time; every job finished or not.

The workers are judged on their private memory (RssAnon) and on the shared-memory files they map, not on
their resident size: the frames a writer hands its segment encoders live in one shared arena that every
encoder maps and keeps for the next job (media/segment_pool.py), and each page of it counts in the resident
size of every process that has touched it. On 16 cores eight encoders, each taking other slots each job,
add the same 440 MiB (at 720p) up to eight times over; the memory is the server's, counted once in its own.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from lipstream.aio import wait_for
from lipstream.bench.serve_load import resident_avatars
from lipstream.media.encode_pool import SHM_PREFIX

FLAT_PCT = 5.0  # a series passes when its last sample is within this of its first after the warm-up
COUNT_SLACK = 2  # ... or, for counts (open files, threads, mapped files), within this many: a pool's lazy
# thread is no leak
PRIVATE_SLACK_MIB = 8.0  # ... or, for the workers' private memory, within this many MiB: a small pool's heap
# swings by a few MiB from one quiet sample to the next (an encoder's buffers until its next trim), 18 % of a
# 23 MiB encode worker on 2 cores
WARMUP_SHARE = 0.2  # the first fifth of the samples is the warm-up
LATE_SLACK_PER_MIN = 1.0  # late frames: the later half's rate may exceed the earlier's by 5 % and this
QUIET_WAIT_S = 120.0  # the most a sample waits for the open sessions and running jobs to end (beyond the speech)
SETTLE_S = 0.5  # after the last session closed, before a sample
GAP_S = 1.0  # between a session's close and the next one of its slot
JOB_TIMEOUT_S = 600.0  # a job not finished this long after the churn ended is counted as timed out
SPEECH_RATE = 16_000


# --- the server's process and its workers, from /proc ---------------------------------------------------

RSS_PARTS = (("anon", "RssAnon"), ("file", "RssFile"), ("shmem", "RssShmem"))


def _status_fields(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile, RssShmem (kB) and Threads of a process from /proc/PID/status; {} when it is
    gone. The parts say what grows: the heap (anon), libraries and kernels mapped in (file), shared memory."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "Threads"):
                out[key] = int(value.split()[0])
    except (OSError, ValueError):
        return {}
    return out


def _shared_maps(pid: int) -> int | None:
    """The frame-slot and arena files (media/encode_pool.py's SHM_PREFIX) a process maps: one a live session,
    one an arena. A worker that kept a closed session's would grow this, and its shared memory with it."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return None
    return len({line.split(None, 5)[-1] for line in lines if SHM_PREFIX in line})


def _open_files(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    """Every process below `pid` (its workers, and theirs)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = [int(k) for t in Path(f"/proc/{p}/task").iterdir() for k in (t / "children").read_text().split()]
        except (OSError, ValueError):
            continue
        out += kids
        todo += kids
    return out


def _kind(pid: int) -> str:
    """A worker's kind: the module it runs (`python -m lipstream.serve.rtc_worker` -> rtc_worker), else its name."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    args = [a.decode(errors="replace") for a in argv if a]
    if "-m" in args[:-1]:
        return args[args.index("-m") + 1].rsplit(".", 1)[-1]
    return Path(args[0]).name if args else "?"


def process_sample(pid: int) -> dict | None:
    """Resident memory (MiB), open files and threads of the server `pid` and, summed by kind, of the processes
    below it; None when `pid` cannot be read (gone, or not on this machine)."""
    own = _status_fields(pid)
    if not own:
        return None
    workers: dict[str, dict] = {}
    for kid in _children(pid):
        fields = _status_fields(kid)
        if not fields:
            continue
        w = workers.setdefault(_kind(kid), {"processes": 0, "rss_mib": 0.0, "private_mib": 0.0, "shmem_mib": 0.0,
                                            "shared_maps": 0, "open_files": 0, "threads": 0})
        w["processes"] += 1
        for name, key in (("rss_mib", "VmRSS"), ("private_mib", "RssAnon"), ("shmem_mib", "RssShmem")):
            w[name] = round(w[name] + fields.get(key, 0) / 1024, 1)
        w["shared_maps"] += _shared_maps(kid) or 0
        w["open_files"] += _open_files(kid) or 0
        w["threads"] += fields.get("Threads", 0)
    return {"rss_mib": round(own.get("VmRSS", 0) / 1024, 1),
            **{f"rss_{part}_mib": round(own[key] / 1024, 1) for part, key in RSS_PARTS if key in own},
            "open_files": _open_files(pid),
            "threads": own.get("Threads"), "workers": workers,
            **{f"workers_{name}": round(sum(w[name] for w in workers.values()), 1)
               for name in ("rss_mib", "private_mib", "shmem_mib")},
            "workers_shared_maps": sum(w["shared_maps"] for w in workers.values()),
            "workers_open_files": sum(w["open_files"] for w in workers.values()),
            "workers_threads": sum(w["threads"] for w in workers.values()),
            "workers_processes": sum(w["processes"] for w in workers.values())}


# --- the server's own figures, from /metrics ------------------------------------------------------------

def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name' or 'name{labels}': value}."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


def metrics_sample(metrics: dict[str, float]) -> dict:
    """The figures a soak follows from a /metrics scrape (None where the server has none: no GPU)."""
    def get(name: str) -> float | None:
        return metrics.get(name)

    jobs = {k.split('status="', 1)[1].split('"', 1)[0]: int(v) for k, v in metrics.items()
            if k.startswith("lipstream_jobs{")}
    gpu = get("lipstream_gpu_memory_bytes")
    reserved = get("lipstream_gpu_memory_reserved_bytes")
    pinned = get("lipstream_pinned_host_memory_bytes")
    return {"frames_late": int(get("lipstream_live_frames_late") or 0),
            "live_sessions": int(get("lipstream_live_sessions") or 0),
            "jobs_by_status": jobs,
            "gpu_allocated_mib": None if gpu is None else round(gpu / 2**20, 1),
            "gpu_reserved_mib": None if reserved is None else round(reserved / 2**20, 1),
            "pinned_host_mib": None if pinned is None else round(pinned / 2**20, 1),  # part of the RSS
            # the server process's own, when no process id was given (prometheus_client's process collector)
            "process_rss_mib": None if get("process_resident_memory_bytes") is None
            else round(get("process_resident_memory_bytes") / 2**20, 1),
            "process_open_files": None if get("process_open_fds") is None else int(get("process_open_fds"))}


# --- the load ----------------------------------------------------------------------------------------------

class Tally:
    """What the churn did so far: sessions and jobs, by outcome."""

    def __init__(self) -> None:
        self.sessions = {"opened": 0, "closed": 0, "refused": 0, "failed": 0, "utterances_finished": 0}
        self.jobs: dict[str, dict] = {}  # id -> {"status", "submitted", "finished"}
        self.jobs_refused = 0
        self.errors: list[str] = []
        self.open = 0  # sessions connecting or open now
        self.resume = asyncio.Event()  # cleared while a sample waits for the open sessions to close
        self.resume.set()

    def error(self, text: str) -> None:
        if len(self.errors) < 50:  # the first ones say what went wrong; a soak may make thousands
            self.errors.append(text[:300])

    def jobs_count(self) -> dict[str, int]:
        counts = {"submitted": len(self.jobs), "refused": self.jobs_refused, "done": 0, "failed": 0, "cancelled": 0,
                  "unfinished": 0}
        for j in self.jobs.values():
            counts[j["status"] if j["status"] in ("done", "failed", "cancelled") else "unfinished"] += 1
        return counts


async def _one_session(url: str, key: str, avatar: str, speech: np.ndarray, tally: Tally) -> None:
    """Open, speak one utterance, read until it finished (and a second more of pictures), close."""
    from lipstream.client import SessionRefused, connect
    from lipstream.live.items import SpeechEvent

    tally.open += 1
    try:
        session = await connect(url, avatar, api_key=key or None)
    except SessionRefused as e:
        tally.open -= 1
        tally.sessions["refused" if e.status == 503 else "failed"] += 1
        tally.error(f"session: {e}")
        return
    except Exception as e:  # noqa: BLE001 (counted; the soak goes on)
        tally.open -= 1
        tally.sessions["failed"] += 1
        tally.error(f"session: {type(e).__name__}: {e}")
        return
    tally.sessions["opened"] += 1
    finished = False

    async def listen() -> None:
        nonlocal finished
        finished_at = None
        async for item in session:
            if isinstance(item, SpeechEvent) and item.kind == "finished":
                finished, finished_at = True, time.monotonic()
            if finished_at is not None and time.monotonic() - finished_at > 1.0:
                return

    try:
        session.push_audio(speech, SPEECH_RATE)
        session.end_utterance()
        try:  # its utterance finishes, a second more of pictures is read; a stalled stream is a failure
            await wait_for(listen(), speech.size / SPEECH_RATE + 30.0)
        except asyncio.TimeoutError:
            pass
        if finished:
            tally.sessions["utterances_finished"] += 1
        else:
            tally.sessions["failed"] += 1
            tally.error(f"session {session.id}: its utterance did not finish ({session.error or 'no error said'})")
    except Exception as e:  # noqa: BLE001 (a session's failure is counted; the soak goes on)
        tally.sessions["failed"] += 1
        tally.error(f"session {session.id}: {type(e).__name__}: {e}")
    finally:
        try:
            await session.aclose()
        finally:
            tally.open -= 1
            tally.sessions["closed"] += 1


async def _session_slot(slot: int, url: str, key: str, avatars: list[str], speeches: list[np.ndarray],
                        until: float, stagger_s: float, tally: Tally) -> None:
    await asyncio.sleep(slot * stagger_s)
    k = slot
    while time.monotonic() < until:
        await tally.resume.wait()
        if time.monotonic() >= until:
            break
        await _one_session(url, key, avatars[k % len(avatars)], speeches[k % len(speeches)], tally)
        k += 1
        await asyncio.sleep(GAP_S)


async def _jobs(http: httpx.AsyncClient, avatars: list[str], audio: Path, every_s: float, until: float,
                tally: Tally) -> None:
    """A render job every `every_s` until `until`; then follow them until each finished (or the time-out)."""
    k = 0
    next_at = time.monotonic()
    while time.monotonic() < until:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        await tally.resume.wait()
        if time.monotonic() >= until:
            break
        next_at = max(next_at + every_s, time.monotonic())
        try:
            r = await http.post("/v1/jobs/render", data={"avatar": avatars[k % len(avatars)]},
                                files={"audio": (audio.name, audio.read_bytes(), "audio/wav")})
        except httpx.HTTPError as e:
            tally.jobs_refused += 1
            tally.error(f"job submit: {type(e).__name__}: {e}")
            continue
        k += 1
        if r.status_code not in (200, 201, 202):
            tally.jobs_refused += 1
            tally.error(f"job submit: {r.status_code} {r.text[:200]}")
            continue
        tally.jobs[r.json()["id"]] = {"status": "queued", "submitted": time.time(), "seconds": None}
        await _poll_jobs(http, tally)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while time.monotonic() < deadline and tally.jobs_count()["unfinished"]:
        await _poll_jobs(http, tally)
        await asyncio.sleep(1.0)


async def _poll_jobs(http: httpx.AsyncClient, tally: Tally) -> None:
    for job_id, job in tally.jobs.items():
        if job["status"] in ("done", "failed", "cancelled"):
            continue
        try:
            r = await http.get(f"/v1/jobs/{job_id}")
        except httpx.HTTPError:
            continue
        if r.status_code == 200:
            status = r.json()
            job["status"] = status["status"]
            if status.get("started_at") and status.get("finished_at"):
                job["seconds"] = round(status["finished_at"] - status["started_at"], 2)
            if status["status"] == "failed":
                tally.error(f"job {job_id} failed: {status.get('error')}")


async def _quiet_sample(http: httpx.AsyncClient, server_pid: int | None, t0: float, tally: Tally,
                        wait_s: float) -> dict:
    """A sample with no session open and no job running: new ones wait while the open ones finish and close and
    the jobs submitted finish (up to `wait_s`). Why: each open session holds sockets and threads in the server
    and its workers, a running job threads and buffers, so a sample taken with some open would swing by more
    than the 5 % it is judged by; between them a leak is all that differs."""
    tally.resume.clear()
    waited = time.monotonic()
    try:
        while tally.open and time.monotonic() - waited < wait_s:
            await asyncio.sleep(0.05)
        while time.monotonic() - waited < wait_s:  # a running job holds its threads and buffers too
            await _poll_jobs(http, tally)
            if not tally.jobs_count()["unfinished"]:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(SETTLE_S)  # the server's side of the last close (its WebRTC worker's peer) ends
        return {**await _sample(http, server_pid, t0, tally), "quiet_wait_s": round(time.monotonic() - waited, 1),
                "open_at_sample": tally.open, "jobs_unfinished_at_sample": tally.jobs_count()["unfinished"]}
    finally:
        tally.resume.set()


async def _sample(http: httpx.AsyncClient, server_pid: int | None, t0: float, tally: Tally) -> dict:
    try:
        r = await http.get("/metrics")
        metrics = metrics_sample(parse_metrics(r.text)) if r.status_code == 200 else {}
    except httpx.HTTPError as e:
        metrics = {}
        tally.error(f"/metrics: {type(e).__name__}: {e}")
    proc = process_sample(server_pid) if server_pid is not None else None
    if proc is None:  # the server's own account of its process (another machine, or no --server-pid)
        proc = {"rss_mib": metrics.get("process_rss_mib"), "open_files": metrics.get("process_open_files")}
    return {"t_s": round(time.monotonic() - t0, 1), "at": time.strftime("%H:%M:%S"), **proc,
            **{k: v for k, v in metrics.items() if not k.startswith("process_")},
            "sessions": dict(tally.sessions), "jobs": tally.jobs_count()}


async def soak(url: str, key: str, minutes: float, avatars: list[str], *, sessions: int = 2, speak_s: float = 3.0,
               job_every_s: float = 30.0, job_audio: Path | None = None, sample_s: float = 60.0,
               server_pid: int | None = None, progress=print) -> dict:
    """The churn for `minutes` and a sample every `sample_s`; the samples and the tally (not summarised)."""
    from lipstream.fixtures import speech_like, write_audio

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    speeches = [(speech_like(speak_s, SPEECH_RATE, seed=s) * 32767).astype(np.int16) for s in range(4)]
    tally = Tally()
    samples: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="lipstream-soak-") as tmp:
        if job_audio is None:
            job_audio = write_audio(Path(tmp) / "job.wav", speech_like(4.0, SPEECH_RATE, seed=7), SPEECH_RATE)
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
            t0 = time.monotonic()
            before = await _sample(http, server_pid, t0, tally)
            until = t0 + minutes * 60
            load = [asyncio.ensure_future(_session_slot(i, url, key, avatars, speeches, until,
                                                        stagger_s=(speak_s + 3.0) / max(1, sessions), tally=tally))
                    for i in range(sessions)]
            load.append(asyncio.ensure_future(_jobs(http, avatars, job_audio, job_every_s, until, tally)))
            next_at = t0 + sample_s
            while next_at <= until + 1e-6:
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                samples.append(s := await _quiet_sample(http, server_pid, t0, tally, wait_s=speak_s + QUIET_WAIT_S))
                next_at = max(next_at + sample_s, time.monotonic() + sample_s / 2)  # a long wait: skip, not bunch
                gpu = f", GPU {s['gpu_reserved_mib']} MiB" if s.get("gpu_reserved_mib") is not None else ""
                progress(f"{s['at']} t={s['t_s']:.0f}s RSS {s.get('rss_mib')} MiB (anon {s.get('rss_anon_mib')}, "
                         f"workers {s.get('workers_rss_mib')}, private {s.get('workers_private_mib')})"
                         f"{gpu}, files {s.get('open_files')}+{s.get('workers_open_files')}, threads "
                         f"{s.get('threads')}+{s.get('workers_threads')}, late {s.get('frames_late')}, sessions "
                         f"{s['sessions']['opened']}/{s['sessions']['closed']}, jobs {s['jobs']['done']}/"
                         f"{s['jobs']['submitted']}")
            await asyncio.gather(*load)  # the sessions close; the jobs finish (or time out)
            await asyncio.sleep(min(5.0, sample_s))  # the server lets the last ones go
            after = await _sample(http, server_pid, t0, tally)
    return {"samples": samples, "before": before, "after": after, "sessions": tally.sessions,
            "jobs": tally.jobs_count(), "job_seconds": [j["seconds"] for j in tally.jobs.values()],
            "errors": tally.errors}


# --- the report ----------------------------------------------------------------------------------------------

SERIES = ("rss_mib", "open_files", "threads", "workers_private_mib", "workers_shared_maps", "workers_open_files",
          "workers_threads", "gpu_allocated_mib", "gpu_reserved_mib", "pinned_host_mib")
SHOWN = ("workers_rss_mib", "workers_shmem_mib")  # reported, not judged: a shared page counts in each mapper


def warmup_count(n: int) -> int:
    """Samples cut as warm-up: the first fifth, at least one when there are three or more."""
    return min(max(1 if n >= 3 else 0, math.ceil(WARMUP_SHARE * n)), max(0, n - 2))


def series_verdict(times_s: list[float], values: list[float], slack: float = 0.0) -> dict:
    """First, last, max, drift % (last against first) and the least-squares slope per hour of one series;
    it passes within FLAT_PCT, or within `slack` units."""
    first, last = values[0], values[-1]
    drift = 0.0 if first == last else (None if first == 0 else 100.0 * (last - first) / abs(first))  # None: from 0
    slope = float(np.polyfit(np.asarray(times_s) / 3600, values, 1)[0]) if len(values) >= 2 else 0.0
    return {"first": first, "last": last, "max": max(values), "drift_pct": None if drift is None else round(drift, 2),
            "slope_per_hour": round(slope, 2),
            "slope_pct_per_hour": round(100 * slope / abs(first), 2) if first else None,
            "pass": abs(last - first) <= slack or (drift is not None and abs(drift) <= FLAT_PCT)}


def summarise(raw: dict) -> dict:
    """The verdicts of a soak's samples: each series after the warm-up, late frames per minute, jobs, sessions."""
    samples = raw["samples"]
    cut = warmup_count(len(samples))
    after = samples[cut:]
    series, shown = {}, {}
    # each kind of worker on its own too: a small pool's leak is not lost in a big one's sum
    kinds = {f"{kind}_private_mib": kind for kind in sorted({k for s in after for k in s.get("workers", {})})}

    def value(sample: dict, name: str):
        if name in kinds:
            return sample.get("workers", {}).get(kinds[name], {}).get("private_mib")
        return sample.get(name)

    for name in (*SERIES, *kinds, *SHOWN):
        points = [(s["t_s"], value(s, name)) for s in after if value(s, name) is not None]
        if len(points) >= 2:
            slack = (COUNT_SLACK if name.endswith(("open_files", "threads", "maps")) else
                     PRIVATE_SLACK_MIB if name.endswith("private_mib") else 0.0)
            (shown if name in SHOWN else series)[name] = series_verdict([t for t, _ in points],
                                                                         [v for _, v in points], slack)
    late_per_min = []
    for a, b in zip(samples, samples[1:]):
        minutes = (b["t_s"] - a["t_s"]) / 60
        late_per_min.append({"t_s": b["t_s"], "late_per_min": round((b["frames_late"] - a["frames_late"]) / minutes, 2)
                             if minutes > 0 and "frames_late" in a and "frames_late" in b else None})
    rates = [x["late_per_min"] for x in late_per_min[max(0, cut - 1):] if x["late_per_min"] is not None]
    half = len(rates) // 2
    early = float(np.mean(rates[:half])) if half else None
    late = float(np.mean(rates[half:])) if half else None
    late_ok = early is None or late <= early * (1 + FLAT_PCT / 100) + LATE_SLACK_PER_MIN
    jobs = raw["jobs"]
    jobs_ok = jobs["submitted"] > 0 and jobs["done"] == jobs["submitted"]
    sessions = raw["sessions"]
    sessions_ok = sessions["opened"] > 0 and sessions["closed"] == sessions["opened"] and sessions["failed"] == 0
    return {"warmup_samples": cut, "series": series, "shown": shown,
            "late_frames": {"per_minute": late_per_min, "early_mean_per_min": early and round(early, 2),
                            "late_mean_per_min": late and round(late, 2), "pass": late_ok},
            "jobs_all_finished": jobs_ok, "sessions_ok": sessions_ok,
            "pass": all(v["pass"] for v in series.values()) and late_ok and jobs_ok and sessions_ok}


def write(report: dict, out: Path) -> None:
    """soak.json (every sample) and soak.md (the verdicts) under `out`, atomically."""
    out.mkdir(parents=True, exist_ok=True)
    s = report["summary"]
    lines = [f"# serve-bench --soak {report['date']} (commit {report['commit']}, {report['cpus']} CPUs)", "",
             f"`{report['command']}`", "",
             f"{report['minutes']:g} min on {report['url']}; {report['sessions_at_once']} sessions at a time, each "
             f"{report['speak_s']:g} s of speech; a render job every {report['job_every_s']:g} s; a sample every "
             f"{report['sample_s']:g} s ({len(report['samples'])} samples, the first {s['warmup_samples']} cut as "
             f"warm-up). Verdict: **{'PASS' if s['pass'] else 'FAIL'}**", "",
             f"| series | first after warm-up | last | max | drift % | slope /h | slope %/h | within {FLAT_PCT:g} % "
             f"(counts: or {COUNT_SLACK}; workers' private memory: or {PRIVATE_SLACK_MIB:g} MiB) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, v in s["series"].items():
        lines.append(f"| {name} | {v['first']} | {v['last']} | {v['max']} | {v['drift_pct']} | {v['slope_per_hour']} | "
                     f"{v['slope_pct_per_hour']} | {'PASS' if v['pass'] else 'FAIL'} |")
    for name, v in s.get("shown", {}).items():
        lines.append(f"| {name} | {v['first']} | {v['last']} | {v['max']} | {v['drift_pct']} | {v['slope_per_hour']} | "
                     f"{v['slope_pct_per_hour']} | shown, not judged |")
    lf = s["late_frames"]
    lines += ["", f"Late frames per minute (server's count), sample by sample: "
                  f"{', '.join(str(x['late_per_min']) for x in lf['per_minute']) or 'none'}; after the warm-up, "
                  f"earlier half {lf['early_mean_per_min']}, later half {lf['late_mean_per_min']}: "
                  f"{'PASS' if lf['pass'] else 'FAIL'} (the later may exceed the earlier by {FLAT_PCT:g} % + "
                  f"{LATE_SLACK_PER_MIN:g}/min)", ""]
    j, ss = report["jobs"], report["sessions"]
    lines += [f"Jobs: {j['submitted']} submitted, {j['done']} done, {j['failed']} failed, {j['unfinished']} not finished "
              f"(timed out), {j['refused']} refused: all finished **{'yes' if s['jobs_all_finished'] else 'no'}**",
              f"Sessions: {ss['opened']} opened, {ss['closed']} closed, {ss['refused']} refused (full), {ss['failed']} "
              f"failed, {ss['utterances_finished']} utterances finished", ""]
    b, a = report["before"], report["after"]
    parts = ", ".join(f"{part} {b.get(f'rss_{part}_mib')} -> {a.get(f'rss_{part}_mib')}" for part, _ in RSS_PARTS
                      if f"rss_{part}_mib" in a)
    lines += [f"Idle, before the load and after it (every session closed, every job finished): resident "
              f"{b.get('rss_mib')} -> {a.get('rss_mib')} MiB ({parts}; workers {b.get('workers_rss_mib')} -> "
              f"{a.get('workers_rss_mib')}, their private memory {b.get('workers_private_mib')} -> "
              f"{a.get('workers_private_mib')}), open files {b.get('open_files')} -> {a.get('open_files')} (workers "
              f"{b.get('workers_open_files')} -> {a.get('workers_open_files')}), threads {b.get('threads')} -> "
              f"{a.get('threads')}, GPU reserved {b.get('gpu_reserved_mib')} -> {a.get('gpu_reserved_mib')} MiB"]
    if report["errors"]:
        lines += ["", "First errors:", *[f"- {e}" for e in report["errors"][:10]]]
    for name, text in (("soak.json", json.dumps(report, indent=1)), ("soak.md", "\n".join(lines) + "\n")):
        tmp = out / (name + ".part")
        tmp.write_text(text)
        tmp.replace(out / name)


def run(url: str, key: str, minutes: float, avatars: list[str] | None = None, *, sessions: int = 2,
        speak_s: float = 3.0, job_every_s: float = 30.0, job_audio: Path | None = None, sample_s: float = 60.0,
        server_pid: int | None = None, command: str = "", progress=print) -> dict:
    """Check the server (ready, key, avatars), soak it, summarise; the report (not written)."""
    known = set(resident_avatars(url, key))
    chosen = avatars or sorted(known)
    missing = [a for a in chosen if a not in known]
    if missing or not chosen:
        raise RuntimeError(f"avatars {missing or chosen} are not resident on {url} (it has {sorted(known)})")
    raw = asyncio.run(soak(url, key, minutes, chosen, sessions=sessions, speak_s=speak_s, job_every_s=job_every_s,
                           job_audio=job_audio, sample_s=sample_s, server_pid=server_pid, progress=progress))
    return {"command": command, "url": url, "avatars": chosen, "minutes": minutes, "sessions_at_once": sessions,
            "speak_s": speak_s, "job_every_s": job_every_s, "sample_s": sample_s, "server_pid": server_pid,
            "date": time.strftime("%Y-%m-%d %H:%M"), "commit": os.environ.get("LIPSTREAM_COMMIT", "?"),
            "cpus": os.cpu_count(), **raw, "summary": summarise(raw)}
