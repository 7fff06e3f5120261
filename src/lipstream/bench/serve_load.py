"""`lipstream serve-bench`: a load test of a running `lipstream serve`, by real clients over the network.

Each row opens N live sessions, each an aiortc client in a process of its own
(lipstream.bench.serve_client), that all start speaking at one moment, for `seconds`; a render
job may run beside them (it shares the GPU scheduler at lower priority). The figures are the
clients': audio -> frame latency per speech frame (audio sent -> the frame's last RTP
packet in; and -> the frame decoded by aiortc), frames that never arrived, the audio-video
offset; with the server's own count of frames late (played as the previous picture), and its CPU
when its process id is given. A warm-up row at the largest N comes first and is not reported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from lipstream.bench.proc import CLIENT_NICE, children_cpu_s, host_busy_s, process_cpu_s
from lipstream.client.jobs import key_refusal
from lipstream.errors import LipStreamError

TARGET_P99_MS = 250.0
CONNECT_S = 6.0  # clients start (imports, offer, answer) before the common start
WARMUP_S = 4.0
# serve-bench reads the key where the server it usually runs beside reads its keys
KEY_VARIABLE = "set LIPSTREAM_API_KEYS=KEY (serve-bench sends the first key listed)"


def submit_render_job(http: httpx.Client, avatar: str, audio: Path) -> str:
    """POST a render job of `audio` on `avatar`; its id."""
    with open(audio, "rb") as f:
        r = http.post("/v1/jobs/render", data={"avatar": avatar}, files={"audio": (audio.name, f, "audio/wav")})
    r.raise_for_status()
    return r.json()["id"]


def run_row(url: str, key: str, n: int, seconds: float, avatars: list[str], *, render_audio: Path | None = None,
            server_pid: int | None = None, seed: int = 0, codec: str = "any", chunk_ms: float = 20.0,
            playout_delay_ms: float | None = None, latency: str | None = None) -> dict:
    """N client processes for `seconds` (and a render job if asked); the figures of one row."""
    env = {**os.environ, "LIPSTREAM_API_KEY": key, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with tempfile.TemporaryDirectory(prefix="lipstream-serve-bench-") as tmp, \
            httpx.Client(base_url=url, headers=headers, timeout=60) as http:
        start = time.time() + CONNECT_S
        procs = []
        for k in range(n):
            out = Path(tmp) / f"client{k}.json"
            cmd = [sys.executable, "-m", "lipstream.bench.serve_client", "--url", url, "--avatar",
                   avatars[k % len(avatars)], "--start", str(start), "--seconds", str(seconds),
                   "--seed", str(seed * 1000 + k), "--codec", codec, "--chunk-ms", str(chunk_ms), "--out", str(out)]
            if playout_delay_ms is not None:
                cmd += ["--playout-delay-ms", str(playout_delay_ms)]
            if latency is not None:
                cmd += ["--latency", latency]
            # the load must not take the CPU the server under test needs: clients run at a lower priority
            procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                           preexec_fn=lambda: os.nice(CLIENT_NICE)), out))
        time.sleep(max(0.0, start - time.time()))
        cpu0, kids0, host0, t0 = process_cpu_s(server_pid), children_cpu_s(server_pid), host_busy_s(), time.monotonic()
        engine0 = engine_counters(http)
        job = submit_render_job(http, avatars[0], render_audio) if render_audio is not None else None
        job_s = None
        clients, errors = [], []
        for proc, out in procs:
            try:
                _, err = proc.communicate(timeout=CONNECT_S + seconds + 90)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            report = json.loads(out.read_text()) if out.exists() else {"error": f"exit {proc.returncode}"}
            if "error" in report:
                errors.append(report["error"] + (f" ({err.decode(errors='replace').strip().splitlines()[-1]})"
                                                 if err.strip() else ""))
            else:
                clients.append(report)
        wall = time.monotonic() - t0
        cpu1, kids1, host1 = process_cpu_s(server_pid), children_cpu_s(server_pid), host_busy_s()
        engine1 = engine_counters(http)
        if job is not None:
            while True:  # the job may outlast the row
                status = http.get(f"/v1/jobs/{job}").json()
                if status["status"] in ("done", "failed", "cancelled"):
                    break
                time.sleep(0.2)
            job_s = {"status": status["status"], "seconds": round(status["finished_at"] - status["started_at"], 2)
                     if status.get("started_at") and status.get("finished_at") else None,
                     "queued_s": round(status["started_at"] - status["created_at"], 2)
                     if status.get("started_at") else None}
    lat = [x for c in clients for x in c["latency_ms"]]
    firsts = [c["first_frame_s"] for c in clients if c["first_frame_s"] is not None]  # none: no client got video
    decoded = [x for c in clients for x in c["decoded_latency_ms"]]
    heard = [x for c in clients for x in c.get("audio_latency_ms", [])]
    heard_decoded = [x for c in clients for x in c.get("decoded_audio_latency_ms", [])]
    quantiles = (lambda xs: {f"p{q}": round(float(np.percentile(xs, q)), 1) for q in (50, 99)} if xs else {})
    offsets = [c["av_offset_ms"] for c in clients if c["av_offset_ms"] is not None]
    decoded_offsets = [c["av_offset_decoded_ms"] for c in clients if c.get("av_offset_decoded_ms") is not None]
    spread = (lambda xs: {"median": round(float(np.median(xs)), 1), "max_abs": round(max(map(abs, xs)), 1)} if xs else {})
    stages = _stages([c["server_timings_ms"] for c in clients if c.get("server_timings_ms")])
    cores = (lambda a, b: round((b - a) / wall, 2) if a is not None and b is not None else None)
    row = {
        "sessions": n,
        "playout_delay_ms": next((c["server_playout_delay_ms"] for c in clients), None),
        "window_ahead_ms": next((c.get("server_window_ahead_ms") for c in clients), None),
        "clients_ok": len(clients),
        "video_codecs": sorted({c["video_codec"] for c in clients}),
        "errors": errors,
        "latency_ms": {f"p{q}": round(float(np.percentile(lat, q)), 1) for q in (50, 95, 99)} if lat else {},
        "latency_ms_max": round(max(lat), 1) if lat else None,
        # each session's own p99, worst first: one slow session (its route, its start) or all of them a little
        "latency_ms_p99_by_session": sorted((round(float(np.percentile(c["latency_ms"], 99)), 1)
                                             for c in clients if c["latency_ms"]), reverse=True),
        "decoded_latency_ms": quantiles(decoded),
        # speech -> the frame's sound: its first audio packet at the client, and aiortc's decoded audio frame
        "audio_latency_ms": quantiles(heard), "decoded_audio_latency_ms": quantiles(heard_decoded),
        "speech_frames": len(lat),
        "frames_late": sum(c["server_frames_late"] or 0 for c in clients),  # the server's: previous picture again
        "frames_played": sum(c["server_frames_played"] or 0 for c in clients),
        "video_frames_received": sum(c["video_frames"] for c in clients),
        "video_frames_missing": sum(c["video_frames_missing"] or 0 for c in clients),  # never arrived (late, dropped)
        "utterances": [sum(c["utterances_sent"] for c in clients), sum(c["utterances_started"] for c in clients),
                       sum(c["utterances_finished"] for c in clients)],  # sent, started, finished
        "av_offset_ms": spread(offsets),  # video minus audio as the packets arrived: the server's sync
        "av_offset_decoded_ms": spread(decoded_offsets),  # as aiortc handed them over (its buffers differ by track)
        "first_frame_s": {f"p{q}": round(float(np.percentile(firsts, q)), 2) for q in (50, 100)} if firsts else {},
        "render_job": job_s,
        "server_stages_ms": stages,  # the server's account of each speech frame (GET /v1/sessions/{id})
        "server_skipped": sum((c.get("server_stats") or {}).get("skipped", 0) for c in clients),
        "server_underruns": sum((c.get("server_stats") or {}).get("underruns", 0) for c in clients),
        "server_cpu_cores": cores(cpu0, cpu1),
        "worker_processes_cores": cores(kids0, kids1),  # the server's children: encode and WebRTC workers
        "host_busy_cores": cores(host0, host1),  # everything on the machine, the clients included
        "client_cores": round(sum(c.get("cpu_s", 0) for c in clients) / (wall + CONNECT_S), 2),
        "wall_s": round(wall, 1),
        **_engine_row(engine0, engine1, wall),
    }
    row["holds"] = bool(lat) and not errors and row["latency_ms"]["p99"] <= TARGET_P99_MS and row["frames_late"] == 0
    return row


ENGINE_COUNTERS = {"steps": "lipstream_engine_steps", "steps_after_idle": "lipstream_engine_steps_after_idle",
                   "gpu_busy_s": "lipstream_engine_gpu_busy_seconds", "core_cpu_s": "lipstream_engine_core_cpu_seconds",
                   "frames": "lipstream_live_frames_rendered",
                   "offline_frames": "lipstream_offline_frames"}


def engine_counters(http: httpx.Client) -> dict[str, float]:
    """The engine's counters from the server's /metrics (summed over a fleet's replicas); {} when unreadable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        families = list(text_string_to_metric_families(http.get("/metrics").text))
    except (httpx.HTTPError, ValueError):
        return {}
    wanted = {metric: key for key, metric in ENGINE_COUNTERS.items()}
    out: dict[str, float] = {}
    for family in families:
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] = out.get(wanted[sample.name], 0.0) + sample.value
    return out


def _engine_row(before: dict[str, float], after: dict[str, float], wall: float) -> dict:
    """What the engine did during a row: steps, frames a step, GPU busy, steps launched after the GPU ran dry,
    and how busy its core thread was (near 100%: the core's Python is what falls behind, not the GPU)."""
    if not before or not after or "steps" not in after:
        return {}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ENGINE_COUNTERS}
    return {"engine_steps": int(d["steps"]),
            "engine_frames_per_step": round((d["frames"] + d["offline_frames"]) / d["steps"], 2) if d["steps"] else None,
            "engine_steps_after_idle": int(d["steps_after_idle"]),
            "engine_gpu_busy_pct": round(100 * d["gpu_busy_s"] / wall, 1) if wall > 0 else None,
            "engine_core_busy_pct": round(100 * d["core_cpu_s"] / wall, 1) if wall > 0 else None}


def _stages(per_client: list[dict[str, list[float]]]) -> dict:
    """p50 / p99 of each stage over every speech frame; and, over the frames ready after their
    deadline, each stage's median: which one made them late."""
    if not per_client:
        return {}
    names = list(per_client[0])
    pooled = {k: np.concatenate([np.asarray(c[k], float) for c in per_client]) for k in names}
    late = pooled["slack"] < 0
    out = {k: {"p50": round(float(np.percentile(v, 50)), 1), "p99": round(float(np.percentile(v, 99)), 1)}
           for k, v in pooled.items() if v.size}
    out["frames"], out["ready_after_deadline"] = int(late.size), int(late.sum())
    if late.any():
        out["late_median"] = {k: round(float(np.median(v[late])), 1) for k, v in pooled.items()}
    return out


def resident_avatars(url: str, key: str) -> dict[str, dict]:
    """The server's avatars by name (as GET /v1/avatars lists them), once it says it is ready and takes the key."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as http:
        ready = http.get("/readyz")
        if ready.status_code != 200:
            raise RuntimeError(f"{url}/readyz answered {ready.status_code}: the server is not ready")
        listed = http.get("/v1/avatars")
        if listed.status_code in (401, 403):
            raise LipStreamError(key_refusal(url, listed.status_code, bool(key), KEY_VARIABLE))
        listed.raise_for_status()
        return {a["name"]: a for a in listed.json()}


def run(url: str, key: str, counts: list[int], seconds: float, avatars: list[str] | None = None, *,
        render_audio: Path | None = None, server_pid: int | None = None, warmup: bool = True,
        codec: str = "any", chunk_ms: float = 20.0, playout_delays_ms: list[float | None] | None = None,
        latency: str | None = None, command: str = "", progress=print) -> dict:
    """Every row (each playout delay, each N), after a warm-up at the largest N; the report (not written)."""
    known = resident_avatars(url, key)
    chosen = avatars or sorted(known)
    missing = [a for a in chosen if a not in known]
    if missing or not chosen:
        raise RuntimeError(f"avatars {missing or chosen} are not resident on {url} (it has {sorted(known)})")
    report = {"command": command, "url": url, "avatars": {a: f"{known[a]['width']}x{known[a]['height']}@{known[a]['fps']}"
                                                          for a in chosen},
              "seconds": seconds, "codec": codec, "chunk_ms": chunk_ms, "latency": latency,
              "render_audio": str(render_audio) if render_audio else None,
              "date": time.strftime("%Y-%m-%d %H:%M"), "commit": os.environ.get("LIPSTREAM_COMMIT", "?"),
              "cpus": os.cpu_count(), "rows": []}
    if warmup:
        w = run_row(url, key, max(counts), WARMUP_S, chosen, server_pid=server_pid, seed=99, codec=codec,
                    chunk_ms=chunk_ms)
        progress(f"warm-up: {w['sessions']} sessions, {w['clients_ok']} ok, p99 {w['latency_ms'].get('p99')} ms")
    rows = [(d, n) for d in (playout_delays_ms or [None]) for n in counts]
    for i, (delay, n) in enumerate(rows):
        row = run_row(url, key, n, seconds, chosen, render_audio=render_audio, server_pid=server_pid, seed=i,
                      codec=codec, chunk_ms=chunk_ms, playout_delay_ms=delay, latency=latency)
        report["rows"].append(row)
        st = row["server_stages_ms"]
        progress(f"N={n} at {row['playout_delay_ms']} ms: p50/p99 {row['latency_ms'].get('p50')}/"
                 f"{row['latency_ms'].get('p99')} ms (audio {row['audio_latency_ms'].get('p50')}/"
                 f"{row['audio_latency_ms'].get('p99')}), {row['frames_late']} late, {row['video_frames_missing']} missing, "
                 f"errors {len(row['errors'])}; server stages p99 "
                 f"{ {k: v['p99'] for k, v in st.items() if isinstance(v, dict) and 'p99' in v} }, "
                 f"late by {st.get('late_median')}; cores host {row['host_busy_cores']} server "
                 f"{row['server_cpu_cores']} workers {row['worker_processes_cores']} clients {row['client_cores']}")
    held = [r["sessions"] for r in report["rows"] if r["holds"]]
    report["largest_n"] = max(held) if held else None
    report["largest_n_by_delay"] = {str(d): max([r["sessions"] for r in report["rows"]
                                                 if r["holds"] and r["playout_delay_ms"] == d], default=None)
                                    for d in sorted({r["playout_delay_ms"] for r in report["rows"]}, key=str)}
    return report


def write(report: dict, out: Path) -> None:
    """serve_bench.json and serve_bench.md under `out`, atomically."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# serve-bench {report['date']} (commit {report['commit']}, {report['cpus']} CPUs)", "",
             f"`{report['command']}`", "", f"avatars: {report['avatars']}; {report['seconds']} s a row; video {report['codec']} offered, speech in "
             f"{report['chunk_ms']:g} ms chunks; "
             f"render job beside: {report['render_audio'] or 'none'}", "",
             "| N | playout ms | p50 / p95 / p99 ms | max ms | decoded p50 / p99 ms | audio p50 / p99 ms (packets; decoded) | speech frames | late (server) | missing (client) | A/V offset ms "
             "(median, max; decoded) | first frame s | render job s | server stages p99 ms (audio, features, render, encode) | "
             "cores: host, server, its workers (encode, WebRTC), clients | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        q, av_ = r["latency_ms"], r["av_offset_ms"]
        job = r["render_job"]
        d = r["decoded_latency_ms"]
        a, ad = r.get("audio_latency_ms") or {}, r.get("decoded_audio_latency_ms") or {}
        st = r.get("server_stages_ms") or {}
        stages = ", ".join(str(st.get(k, {}).get("p99")) for k in ("audio", "features", "render", "encode"))
        lines.append(f"| {r['sessions']} | {r.get('playout_delay_ms')} | {q.get('p50')} / {q.get('p95')} / {q.get('p99')} | {r['latency_ms_max']} | "
                     f"{d.get('p50')} / {d.get('p99')} | {a.get('p50')} / {a.get('p99')}; {ad.get('p50')} / {ad.get('p99')} | "
                     f"{r['speech_frames']} | {r['frames_late']} | {r['video_frames_missing']} | "
                     f"{av_.get('median')}, {av_.get('max_abs')}; {r.get('av_offset_decoded_ms', {}).get('median')} | "
                     f"{r['first_frame_s'].get('p50')} | "
                     f"{(job or {}).get('seconds')} | {stages} | {r.get('host_busy_cores')}, {r['server_cpu_cores']}, "
                     f"{r.get('worker_processes_cores', r.get('encode_workers_cores'))}, {r.get('client_cores')} | {len(r['errors'])} |")
    lines += ["", "Latency: audio sent by the client -> the frame's last RTP packet at the client; decoded: -> "
                  "handed over decoded by aiortc (its jitter buffer holds a frame until the next one starts). "
                  "Audio: the same speech -> the frame's sound, its first audio packet and aiortc's decoded frame.",
              "", "A/V offset: video minus audio, each packet's arrival less its media time, as the packets came in "
                  "(the server's sync); decoded: as aiortc handed the frames over (its audio jitter buffer waits "
                  "for 4 packets, its video one holds a frame: an offset the server did not make)."]
    lines += ["", "Server stages, per speech frame: its audio arriving (push of the frame's first sample -> "
                  "the last its window needs), features and scheduling, the step with the copy to host, "
                  "copy-out and H.264 encode."]
    lines += ["", f"Largest N with p99 <= {TARGET_P99_MS:.0f} ms, no frame late, no client error: "
                  f"{report['largest_n']} (by playout delay: {report.get('largest_n_by_delay')})"]
    for name, text in (("serve_bench.json", json.dumps(report, indent=1)), ("serve_bench.md", "\n".join(lines) + "\n")):
        tmp = out / (name + ".part")
        tmp.write_text(text)
        tmp.replace(out / name)
