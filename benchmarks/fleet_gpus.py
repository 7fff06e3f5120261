"""The fleet's figures against a running `lipstream serve --replicas G` (one engine per GPU), from clients
in their own processes:

1. live: `lipstream serve-bench` rows (aiortc clients, each in its own process) at the given session counts:
   the largest N holding 25 fps with no frame late at the default playout delay;
2. jobs: J render jobs submitted together, jobs per minute from the first submit to the last job done,
   and which replica ran each;
3. kill (--kill): jobs queued and 2 live sessions per replica, then one replica's actor killed while it runs
   a job (`ray.kill`, joining the server's local Ray): what became of its jobs (attempts, the runner that
   finished them, nothing partial served) and of its sessions (closed; the others go on), and how long Ray
   Serve took to replace it.

    python benchmarks/fleet_gpus.py --url http://127.0.0.1:8000 --gpus 2 --avatar anchor --audio speech.wav \
        --sessions 32,40,48 --jobs 8 --kill -o OUT/fleet_x2
Writes OUT/fleet_gpus.json. `bash benchmarks/gpu_run.sh fleet` runs it against each server (the jobs together);
docs/BENCHMARKS.md, "Fleet", reports it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from lipstream.bench.serve_load import submit_render_job as _submit

JOB_LIMIT_S = 600.0


def _wait_all(http: httpx.Client, ids: list[str], limit_s: float = JOB_LIMIT_S) -> dict[str, dict]:
    t, done = time.monotonic(), {}
    while len(done) < len(ids) and time.monotonic() - t < limit_s:
        for job_id in ids:
            if job_id not in done:
                job = http.get(f"/v1/jobs/{job_id}").json()
                if job["status"] in ("done", "failed", "cancelled"):
                    done[job_id] = job
        time.sleep(0.2)
    return done


def _replicas_ready(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {m[0]: float(m[1]) for m in re.findall(r'^lipstream_ready\{replica="(\w+)"\} (\S+)$', text, re.M)
            if m[0] != "all"}


def live(url: str, sessions: str, seconds: float, out: Path) -> dict:
    cmd = [sys.executable, "-m", "lipstream.cli", "serve-bench", "--url", url, "--sessions", sessions,
           "--seconds", str(seconds), "-o", str(out / "live")]
    rc = subprocess.run(cmd).returncode
    path = out / "live" / "serve_bench.json"
    report = json.loads(path.read_text()) if path.exists() else {}
    return {"command": " ".join(cmd), "rc": rc, "largest_n": report.get("largest_n"),
            "rows": [{k: r.get(k) for k in ("sessions", "holds", "frames_late", "speech_frames", "latency_ms")}
                     for r in report.get("rows", [])]}


def jobs_together(http: httpx.Client, avatar: str, audio: Path, count: int) -> dict:
    t0 = time.time()
    ids = [_submit(http, avatar, audio) for _ in range(count)]
    done = _wait_all(http, ids)
    ends = [j["finished_at"] for j in done.values() if j["status"] == "done"]
    span = (max(ends) - t0) if ends else None
    runners: dict[str, int] = {}
    for j in done.values():
        runners[j.get("runner") or "?"] = runners.get(j.get("runner") or "?", 0) + 1
    return {"jobs": count, "done": len(ends), "seconds": round(span, 2) if span else None,
            "jobs_per_minute": round(60 * len(ends) / span, 2) if span else None, "by_runner": runners,
            "job_seconds": sorted(round(j["finished_at"] - j["started_at"], 2) for j in done.values()
                                  if j["status"] == "done")}


class Talk:
    """One live session pushing its speech in 20 ms chunks at its pace and counting the frames it gets;
    `ended_at`: when its stream stopped (its replica went), None while it goes on."""

    def __init__(self, session, pcm: np.ndarray, rate: int):
        self.session, self.frames, self.ended_at = session, 0, None
        self.pushing = asyncio.ensure_future(self._push(pcm, rate))
        self.listening = asyncio.ensure_future(self._listen())

    async def _push(self, pcm: np.ndarray, rate: int) -> None:
        step, t = rate // 50, time.monotonic()
        for k, i in enumerate(range(0, len(pcm), step)):
            try:
                self.session.push_audio(pcm[i:i + step], rate)
            except Exception:  # noqa: BLE001 (the session ended under it)
                return
            await asyncio.sleep(max(0.0, t + (k + 1) * 0.02 - time.monotonic()))  # real time, no drift
        self.session.end_utterance()

    async def _listen(self) -> None:
        try:
            async for item in self.session:
                self.frames += hasattr(item, "audio")
        except Exception:  # noqa: BLE001
            pass
        self.ended_at = time.time()

    async def stop(self) -> None:
        for task in (self.pushing, self.listening):
            task.cancel()
        await self.session.aclose()


async def kill(url: str, http: httpx.Client, avatar: str, audio: Path, gpus: int, namespace: str) -> dict:
    import ray

    from lipstream.audio.decode import load_audio
    from lipstream.client import connect

    ray.init(address="auto", namespace=namespace, logging_level="ERROR", log_to_driver=False)
    pcm = load_audio(audio, 16_000)
    ids = [_submit(http, avatar, audio) for _ in range(2 * gpus)]
    sessions = [await connect(url, avatar) for _ in range(2 * gpus)]
    talks = [Talk(s, pcm, 16_000) for s in sessions]
    t = time.monotonic()
    victim_job = None
    while victim_job is None and time.monotonic() - t < 120:
        for job_id in ids:
            job = (await asyncio.to_thread(http.get, f"/v1/jobs/{job_id}")).json()  # the loop carries WebRTC
            if job["status"] == "running" and job["progress"] > 0.1 and job.get("runner"):
                victim_job = job
                break
        await asyncio.sleep(0.2)
    if victim_job is None:
        return {"error": "no job was seen running"}
    victim = victim_job["runner"].split("-", 1)[1]
    killed_at = time.time()
    ray.kill(ray.get_actor(f"SERVE_REPLICA::lipstream#engine#{victim}", namespace="serve"), no_restart=True)
    on_victim = [x for x in talks if x.session.id.startswith(victim + ".")]
    await asyncio.wait([x.listening for x in on_victim], timeout=60) if on_victim else None
    await asyncio.sleep(max(0.0, len(pcm) / 16_000 + 3.0 - (time.monotonic() - t)))  # the others speak on
    sessions_report = [{"id": x.session.id, "on_victim": x in on_victim, "frames": x.frames,
                        "ended_after_kill_s": None if x.ended_at is None else round(x.ended_at - killed_at, 2)}
                       for x in talks]
    for x in talks:
        await x.stop()
    done = await asyncio.to_thread(_wait_all, http, ids)
    replaced_s = None
    t = time.monotonic()
    while time.monotonic() - t < 300:
        ready = {k for k, v in (await asyncio.to_thread(_replicas_ready, http)).items() if v == 1 and k != victim}
        if len(ready) >= gpus:
            replaced_s = round(time.time() - killed_at, 1)
            break
        await asyncio.sleep(1)
    return {"victim": victim, "victim_job": victim_job["id"],
            "jobs": [{k: j.get(k) for k in ("id", "status", "attempts", "runner", "error")} for j in done.values()],
            "sessions": sessions_report,
            "replaced_after_s": replaced_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--gpus", type=int, required=True, help="the fleet's replicas (one per GPU)")
    p.add_argument("--avatar", required=True)
    p.add_argument("--audio", type=Path, required=True, help="the render jobs' speech (the 26 s monologue)")
    p.add_argument("--sessions", default="", help="serve-bench rows, e.g. 32,40,48 (empty: no live rows)")
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--live-report", type=Path, help="instead of --sessions: a serve-bench report of this server")
    p.add_argument("--jobs", type=int, default=0, help="render jobs submitted together (0: none)")
    p.add_argument("--kill", action="store_true", help="kill one replica mid-job (joins the local Ray)")
    p.add_argument("--namespace", default="lipstream", help="the server's Ray namespace")
    p.add_argument("-o", "--out", type=Path, required=True)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    report = {"gpus": a.gpus, "url": a.url, "date": time.strftime("%Y-%m-%d %H:%M"),
              "commit": os.environ.get("LIPSTREAM_COMMIT", "?"), "command": " ".join(sys.argv)}
    with httpx.Client(base_url=a.url, timeout=60) as http:
        report["replicas_ready"] = _replicas_ready(http)
        if a.live_report and a.live_report.exists():
            rows = json.loads(a.live_report.read_text())
            report["live"] = {"report": str(a.live_report), "largest_n": rows.get("largest_n"), "command": rows.get("command"),
                              "rows": [{k: r.get(k) for k in ("sessions", "holds", "frames_late", "speech_frames")}
                                       for r in rows.get("rows", [])]}
        elif a.sessions:
            report["live"] = live(a.url, a.sessions, a.seconds, a.out)
            print("live:", json.dumps(report["live"]["largest_n"]), flush=True)
        if a.jobs:
            report["jobs_together"] = jobs_together(http, a.avatar, a.audio, a.jobs)
            print("jobs:", json.dumps(report["jobs_together"]), flush=True)
        if a.kill:
            report["kill"] = asyncio.run(kill(a.url, http, a.avatar, a.audio, a.gpus, a.namespace))
            print("kill:", json.dumps(report["kill"]), flush=True)
    tmp = a.out / "fleet_gpus.json.part"
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(a.out / "fleet_gpus.json")


if __name__ == "__main__":
    main()
