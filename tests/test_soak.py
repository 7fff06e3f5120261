"""`lipstream serve-bench --soak`: a short soak of a real `lipstream serve` (tiny networks on the CPU) by the
real CLI, its report read back: sessions opened and closed, jobs finished, the server sampled throughout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from serve_process import descendants, serve_process

KEY = "soak-key-0123456789abcdef"
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)
    threads = {k: v for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "TMPDIR") if (v := os.environ.get(k))}
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"), "COLUMNS": "200",
            "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "LIPSTREAM_API_KEYS": KEY, **threads}


@pytest.mark.slow
def test_a_short_soak_churns_sessions_and_jobs_and_samples_the_server(tmp_path, tiny_models):
    from lipstream.fixtures.avatar import tracked_avatar

    tracked_avatar(tmp_path, "anna", tiny_models.vae, tiny_models.fingerprints["vae"], width=320,
                   height=180, seconds=0.6, fps=10, seed=0)
    args = ["--avatars", tmp_path / "avatars", "--data", tmp_path / "data", "--random-weights", "--random-size", "tiny",
            "--device", "cpu", "--live-preset", "cpu", "--capacity-fps", "100"]
    with serve_process(args, _env(), tmp_path / "server.log") as url:
        port = url.rsplit(":", 1)[1]
        pid = next(p for p, cmd in descendants(os.getpid()).items() if " serve " in cmd and f"--port {port}" in cmd)
        p = subprocess.run([sys.executable, "-m", "lipstream", "serve-bench", "--url", url, "--soak", "1",
                            "--sample-s", "6", "--job-every-s", "20", "--speak-s", "2", "--server-pid", str(pid),
                            "-o", tmp_path / "soak"], env=_env(), capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    report = json.loads((tmp_path / "soak" / "soak.json").read_text())
    md = (tmp_path / "soak" / "soak.md").read_text()
    # every sample read the server's process, its workers and its /metrics
    assert len(report["samples"]) >= 8, len(report["samples"])
    for s in report["samples"]:
        assert s["rss_mib"] > 0 and s["open_files"] > 0 and s["threads"] > 0, s
        assert 0 < s["rss_anon_mib"] < s["rss_mib"] and s["rss_file_mib"] > 0, s  # the parts of the resident size
        assert s["workers_processes"] >= 1 and 0 < s["workers_private_mib"] < s["workers_rss_mib"], s  # WebRTC workers
        assert "rtc_worker" in s["workers"], s["workers"]
        assert s["gpu_reserved_mib"] is None and "frames_late" in s  # no GPU here; the server's count
    # the churn: sessions opened, spoke to the end and closed, one after another; every job finished
    sessions, jobs = report["sessions"], report["jobs"]
    assert sessions["opened"] >= 4 and sessions["closed"] == sessions["opened"], sessions
    assert sessions["utterances_finished"] >= 3 and sessions["failed"] == 0, (sessions, report["errors"])
    assert jobs["submitted"] >= 2 and jobs["done"] == jobs["submitted"], (jobs, report["errors"])
    assert report["summary"]["jobs_all_finished"] and report["summary"]["sessions_ok"]
    assert report["after"]["live_sessions"] == 0  # the server let every session go
    s = report["summary"]
    assert s["warmup_samples"] >= 1 and {"rss_mib", "open_files", "threads", "workers_private_mib",
                                         "workers_shared_maps"} <= set(s["series"])
    assert set(s["shown"]) == {"workers_rss_mib", "workers_shmem_mib"} and "rtc_worker_private_mib" in s["series"]
    for v in s["series"].values():
        assert {"first", "last", "max", "drift_pct", "slope_per_hour", "pass"} <= set(v)
    assert len(s["late_frames"]["per_minute"]) == len(report["samples"]) - 1
    assert "| rss_mib |" in md and "all finished **yes**" in md and "Sessions:" in md


def test_the_verdicts_cut_the_warm_up_and_judge_each_series_by_its_drift():
    from lipstream.bench.soak import summarise

    def sample(t, rss, late):
        return {"t_s": t, "rss_mib": rss, "open_files": 50, "threads": 30, "frames_late": late}

    flat = [sample(60 * k, 900 if k == 0 else 500 + (k % 2), 3 * k) for k in range(10)]  # warm-up: 900, then flat
    growing = [sample(60 * k, 500 + 10 * k, 3 * k * k) for k in range(10)]
    raw = {"sessions": {"opened": 5, "closed": 5, "failed": 0}, "jobs": {"submitted": 2, "done": 2}}
    ok, bad = summarise({**raw, "samples": flat}), summarise({**raw, "samples": growing})
    assert ok["warmup_samples"] == 2 and ok["series"]["rss_mib"]["first"] in (500, 501) and ok["pass"]
    assert not bad["series"]["rss_mib"]["pass"] and bad["series"]["rss_mib"]["slope_per_hour"] == pytest.approx(600)
    assert bad["series"]["open_files"]["pass"] and not bad["late_frames"]["pass"] and not bad["pass"]
    assert not summarise({**raw, "samples": flat, "jobs": {"submitted": 2, "done": 1}})["jobs_all_finished"]
    # counts: one more thread (a pool's lazy one) is no leak; a thread each sample is
    pool = [{**sample(60 * k, 500, 0), "threads": 6 + (k > 5)} for k in range(10)]
    leak = [{**sample(60 * k, 500, 0), "threads": 6 + k} for k in range(10)]
    assert summarise({**raw, "samples": pool})["series"]["threads"]["pass"]
    assert not summarise({**raw, "samples": leak})["series"]["threads"]["pass"]


def test_a_sample_reads_the_gpu_and_pinned_host_memory_from_metrics():
    """A GPU server's /metrics carries GPU memory and the pinned host memory (part of its RSS); a CPU one none."""
    from lipstream.bench.soak import metrics_sample, parse_metrics

    text = ("lipstream_gpu_memory_bytes 2097152.0\nlipstream_gpu_memory_reserved_bytes 4194304.0\n"
            "lipstream_pinned_host_memory_bytes 1048576.0\nlipstream_live_frames_late 3.0\n")
    s = metrics_sample(parse_metrics(text))
    assert (s["gpu_allocated_mib"], s["gpu_reserved_mib"], s["pinned_host_mib"], s["frames_late"]) == (2.0, 4.0, 1.0, 3)
    assert metrics_sample(parse_metrics("lipstream_live_frames_late 0\n"))["pinned_host_mib"] is None


def test_the_segment_encoders_shared_arena_is_not_counted_as_their_own_memory(tmp_path):
    """Two segment encoders that map one writer's frame arena, forced on 2 cores: a sample of this process
    finds the arena in both (a mapped file each, its touched pages in their shared memory) and keeps it out of
    their private memory, which the verdict judges; a mapped file more per sample is a leak."""
    from lipstream.bench.soak import process_sample, summarise
    from lipstream.media.mp4 import MP4Writer
    from lipstream.media.segment_pool import segment_pool

    pool = segment_pool(2)
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (64, 360, 320), dtype=np.uint8)  # I420: 240 rows of luma, then chroma
    with MP4Writer(tmp_path / "x.mp4", 320, 240, 25, np.zeros(2 * 48_000, np.float32), encoders=2, processes=True,
                   total_frames=len(frames)) as w:
        for f in frames:
            w.write(f)
    s = process_sample(os.getpid())
    mine = s["workers"]["encode_worker"]
    assert mine["processes"] >= 2 and mine["shared_maps"] >= 2, mine  # the idle arena, kept mapped in each
    assert mine["shmem_mib"] > 0 and mine["private_mib"] + mine["shmem_mib"] <= mine["rss_mib"], mine
    assert {w.pid for w in pool.workers} <= {int(p) for p in _children_of(os.getpid())}
    raw = {"sessions": {"opened": 5, "closed": 5, "failed": 0}, "jobs": {"submitted": 2, "done": 2}}

    def sample(t, shared, private, maps):
        return {"t_s": t, "rss_mib": 500, "workers_rss_mib": private + shared, "workers_shmem_mib": shared,
                "workers_private_mib": private, "workers_shared_maps": maps, "frames_late": 0}

    touched = summarise({**raw, "samples": [sample(60 * k, 40 * k, 300, 8) for k in range(10)]})
    assert touched["pass"] and not touched["shown"]["workers_rss_mib"]["pass"]  # more of the arena touched: shown
    kept = summarise({**raw, "samples": [sample(60 * k, 40 * k, 300, 8 + k) for k in range(10)]})
    assert not kept["series"]["workers_shared_maps"]["pass"] and not kept["pass"]  # a mapping kept per sample


def _children_of(pid: int) -> list[str]:
    return [k for t in Path(f"/proc/{pid}/task").iterdir() for k in (t / "children").read_text().split()]


def test_each_kind_of_worker_is_judged_on_its_own():
    """Four WebRTC workers growing 3 MiB a sample beside 22 flat encode workers: within 5 % in their sum,
    a failure on their own."""
    from lipstream.bench.soak import summarise

    def sample(t, k):
        workers = {"encode_worker": {"processes": 22, "private_mib": 530.0},
                   "rtc_worker": {"processes": 4, "private_mib": 150.0 + 3 * k}}
        return {"t_s": t, "rss_mib": 500, "frames_late": 0, "workers": workers,
                "workers_private_mib": sum(w["private_mib"] for w in workers.values())}

    raw = {"sessions": {"opened": 5, "closed": 5, "failed": 0}, "jobs": {"submitted": 2, "done": 2},
           "samples": [sample(60 * k, k) for k in range(10)]}
    s = summarise(raw)
    assert s["series"]["workers_private_mib"]["pass"] and s["series"]["encode_worker_private_mib"]["pass"]
    assert not s["series"]["rtc_worker_private_mib"]["pass"] and not s["pass"]
