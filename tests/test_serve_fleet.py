"""`lipstream serve --replicas 2` for real (issue 26): a local Ray started once for the module with two
logical GPUs, the fleet application (serve/fleet/start.py) deployed on it with two engine replicas of tiny
networks, reached through Ray's HTTP proxy on loopback by real clients (httpx; lipstream.client's
aiortc WebRTC and speech socket). Jobs go to both replicas and equal a single server's; live sessions
land on both and a third over capacity is refused with 503; several sessions of one replica speaking at once
reach it in one stream of calls (at most one every 20 ms); a replica killed mid-job loses the job to the
other and its session ends.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'lipstream[ray]')")
pytest.importorskip("aiortc")

from lipstream.fixtures import speech_like, write_audio  # noqa: E402
from lipstream.fixtures.avatar import tracked_avatar  # noqa: E402
from serve_process import free_port, listen, processes, speaks  # noqa: E402

pytestmark = pytest.mark.slow  # a local Ray with two replicas: `make test` only

KEY = "fleet-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
LEASE_S = 2.0  # short: a killed replica's job is taken over within seconds
CAPACITY_FPS = 30.0  # each replica admits one 25 fps session (95% of 30 is 28.5)


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_models) -> Path:
    root = tmp_path_factory.mktemp("fleet")
    tracked_avatar(root, "anna", tiny_models.vae, tiny_models.fingerprints["vae"], width=320, height=180, seed=0)
    write_audio(root / "hello.wav", speech_like(1.6, 16_000, seed=3), 16_000)
    write_audio(root / "talk.wav", speech_like(2.4, 16_000, seed=5), 16_000)
    write_audio(root / "long.wav", speech_like(12.0, 16_000, seed=4), 16_000)
    return root


def _options(root: Path, data: str):
    from lipstream.serve.options import ServeOptions

    return ServeOptions(root / "avatars", root / data, api_keys=(KEY,), jobs_per_key=8, sessions_per_key=8,
                        live_preset="cpu", live_capacity_fps=CAPACITY_FPS, rtc_workers=1, runner_id="fleet",
                        lease_s=LEASE_S)


@pytest.fixture(scope="module")
def fleet(root):
    """The base URL of a two-replica fleet, once both replicas are ready. Ray starts once for the module."""
    import ray
    from ray import serve

    from lipstream.serve.fleet.replica import EngineWeights
    from lipstream.serve.fleet.start import APP, fleet_app

    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, namespace="lipstream-test",
             logging_level="ERROR", log_to_driver=False)  # "local": never a `ray start` cluster left on the machine
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        weights = EngineWeights(random_weights=True, random_size="tiny", device="cpu", compile="off")
        serve.run(fleet_app(_options(root, "data"), weights, 2, gpus_per_replica=1.0), name=APP, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        _wait_replicas(url, 2)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def _metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=30).text


def _replicas(text: str) -> dict[str, float]:
    """replica -> lipstream_ready, from the fleet's /metrics."""
    return {m[0]: float(m[1]) for m in re.findall(r'^lipstream_ready\{replica="(\w+)"\} (\S+)$', text, re.M)
            if m[0] != "all"}


def _wait_replicas(url: str, n: int, timeout: float = 240.0, without: str | None = None) -> dict[str, float]:
    t = time.monotonic()
    while True:
        try:
            if httpx.get(f"{url}/readyz", timeout=10).status_code == 200:
                ready = {k: v for k, v in _replicas(_metrics(url)).items() if v == 1 and k != without}
                if len(ready) >= n:
                    return ready
        except httpx.HTTPError:
            pass
        assert time.monotonic() - t < timeout, f"{n} ready replicas never came up"
        time.sleep(0.5)


def _submit(url: str, audio: Path) -> dict:
    with open(audio, "rb") as f:
        r = httpx.post(f"{url}/v1/jobs/render", data={"avatar": "anna"}, files={"audio": (audio.name, f, "audio/wav")},
                       headers=AUTH, timeout=60)
    assert r.status_code == 202, r.text
    return r.json()


def _job(url: str, job_id: str) -> dict:
    return httpx.get(f"{url}/v1/jobs/{job_id}", headers=AUTH, timeout=30).json()


def _wait_job(url: str, job_id: str, until, timeout: float = 180.0, what: str = "") -> dict:
    t = time.monotonic()
    while True:
        job = _job(url, job_id)
        if until(job):
            return job
        assert job["status"] not in ("failed", "cancelled"), job
        assert time.monotonic() - t < timeout, f"job {job_id} never {what}: {job}"
        time.sleep(0.1)


def _offline_frames(text: str) -> dict[str, float]:
    return {m[0]: float(m[1]) for m in re.findall(r'^lipstream_offline_frames\{replica="(\w+)"\} (\S+)$', text, re.M)}


def _store(root: Path):
    from lipstream.serve.store.database import open_store

    return open_store(root / "data" / "jobs.sqlite3", runner_id="test", lease_s=LEASE_S)


def test_jobs_run_on_both_replicas_and_equal_a_single_server(fleet, root, tiny_models):
    """Jobs submitted together: both replicas claim some (their runner ids, their own frame counters), each
    job once; every MP4 holds what one `lipstream serve` process makes of the same input."""
    from lipstream.serve.server import in_thread
    from lipstream.serve.service import Service

    audios = [root / "talk.wav", root / "hello.wav", root / "talk.wav", root / "hello.wav"]
    jobs = [_submit(fleet, a) for a in audios]
    done = [_wait_job(fleet, j["id"], lambda j: j["status"] == "done", what="done") for j in jobs]
    store = _store(root)
    try:
        rows = [store.get(j["id"]) for j in jobs]
    finally:
        store.close()
    assert all(r.attempts == 1 for r in rows), rows
    runners = {r.runner_id for r in rows}
    assert len(runners) == 2 and all(r.startswith("fleet-") for r in runners), runners
    text = _metrics(fleet)
    frames = _offline_frames(text)
    total = frames.pop("all")
    # each replica's own process figures, labelled, in one exposition Prometheus parses (no family twice)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {s.labels["replica"] for s in families["process_cpu_seconds"].samples} == set(frames)
    assert {s.labels["replica"] for s in families["lipstream_gc_pause_seconds"].samples} == set(frames)
    assert len(frames) == 2 and all(v > 0 for v in frames.values()) and total == sum(frames.values()), frames
    assert {f"fleet-{k}" for k in frames} == runners
    fleet_mp4 = [httpx.get(f"{fleet}{d['result']}", headers=AUTH, timeout=60).content for d in done]

    service = Service(_options(root, "single"), tiny_models).start()
    try:
        with in_thread(service) as url:
            single = [_submit(url, a) for a in audios[:2]]
            single_done = [_wait_job(url, j["id"], lambda j: j["status"] == "done", what="done") for j in single]
            single_mp4 = [httpx.get(f"{url}{d['result']}", headers=AUTH, timeout=60).content for d in single_done]
    finally:
        service.stop()
    for k in range(4):
        _same_media(fleet_mp4[k], single_mp4[k % 2])


def _decoded(mp4: bytes) -> tuple[list[np.ndarray], np.ndarray]:
    import io

    import av

    with av.open(io.BytesIO(mp4)) as c:
        video = [f.to_ndarray(format="yuv420p") for f in c.decode(video=0)]
    with av.open(io.BytesIO(mp4)) as c:
        audio = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])
    return video, audio


def _same_media(a: bytes, b: bytes) -> None:
    """The same pictures and the same sound. As in test_serve's job-against-CLI check: the engine's steps
    batch as the moment allows (a code value apart here and there on the CPU) and x264 spreads that a
    little, so each picture is compared by PSNR (equal ones are well over 40 dB)."""
    (va, aa), (vb, ab) = _decoded(a), _decoded(b)
    assert len(va) == len(vb) > 10
    psnr = [10 * np.log10(255 ** 2 / max(1e-9, np.mean((x.astype(np.float64) - y) ** 2))) for x, y in zip(va, vb)]
    assert min(psnr) > 40, psnr
    assert aa.shape == ab.shape
    np.testing.assert_allclose(aa, ab, atol=1e-4)


def test_two_sessions_land_on_two_replicas_and_a_third_is_refused(fleet):
    from lipstream.client import SessionRefused, connect

    async def main():
        a = await connect(fleet, "anna", api_key=KEY, fps=25)
        b = await connect(fleet, "anna", api_key=KEY, fps=25)
        try:
            assert a.id.split(".")[0] != b.id.split(".")[0], (a.id, b.id)  # the id names its replica
            with pytest.raises(SessionRefused, match="503"):
                await connect(fleet, "anna", api_key=KEY, fps=25)
            for s in (a, b):
                await speaks(s)
            listed = httpx.get(f"{fleet}/v1/sessions", headers=AUTH, timeout=30).json()
            assert sorted(x["id"] for x in listed) == sorted([a.id, b.id])
            status = httpx.get(f"{fleet}/v1/sessions/{a.id}", headers=AUTH, timeout=30)
            assert status.status_code == 200 and status.json()["id"] == a.id
        finally:
            await a.aclose()
            await b.aclose()
        assert httpx.get(f"{fleet}/v1/sessions", headers=AUTH, timeout=30).json() == []
        assert httpx.get(f"{fleet}/v1/sessions/{a.id}", headers=AUTH, timeout=30).status_code == 404

    asyncio.run(main())


def test_the_speech_of_a_replicas_sessions_goes_in_one_stream_of_calls(fleet):
    """Six sessions (6 fps: up to four a replica) streaming speech at once in 20 ms chunks, as a TTS
    would: each replica has at most one speech call every CHANNEL_BATCH_S whatever its number of sessions
    (its calls carry several sessions' speech), nearly all over the front's connection to it (serve/fleet/channel.py),
    and every session gets its pictures, audio and events."""
    from ray import serve

    from lipstream.client import connect
    from lipstream.serve.fleet.front import APP, ENGINE
    from lipstream.serve.fleet.speech import CHANNEL_BATCH_S

    engine = serve.get_deployment_handle(ENGINE, app_name=APP)

    async def counts(names):
        return {n: await asyncio.wait_for(engine.options(session_id=n).speech_counts.remote(), 30) for n in names}

    async def main():
        sessions = [await connect(fleet, "anna", api_key=KEY, fps=6) for _ in range(6)]
        try:
            names = {s.id.split(".")[0] for s in sessions}
            before = await counts(names)
            pushing_s = max(await asyncio.gather(*(_streams(s, seconds=2.0) for s in sessions)))
            after = await counts(names)
        finally:
            for s in sessions:
                await s.aclose()
        calls = {n: after[n]["calls"] - before[n]["calls"] for n in names}
        by_channel = {n: after[n]["by_channel"] - before[n]["by_channel"] for n in names}
        for n in names:  # over the front's own connection, but those sent while it was being made (by Ray)
            assert calls[n] >= by_channel[n] >= 0.8 * calls[n], (by_channel, calls)
        carried = {n: after[n]["session_batches"] - before[n]["session_batches"] for n in names}
        on = {n: sum(s.id.startswith(n + ".") for s in sessions) for n in names}
        busiest = max(on, key=on.get)
        assert on[busiest] >= 3, on
        print(f"speech calls/s by replica: { {n: round(calls[n] / pushing_s, 1) for n in names} } over "
              f"{pushing_s:.2f} s of pushing, sessions {on}, calls {calls}, session batches {carried}")
        for n in names:  # the speech (and its end) went out in at most one call every CHANNEL_BATCH_S (those
            assert 0 < calls[n] <= (pushing_s + 0.2) / CHANNEL_BATCH_S + 2, (calls, on, pushing_s)  # by Ray: fewer)
        # a call carries several sessions: 3 or more send 150 chunks/s or more, in at most 100 calls/s
        assert carried[busiest] >= 1.2 * calls[busiest], (carried, calls, on)

    asyncio.run(main())


async def _streams(session, seconds: float) -> float:
    """`seconds` of speech pushed in 20 ms chunks in real time, then its end: it comes back as pictures with
    their audio and speech events (the session's fps: a 6 fps one has 12 pictures for 2 s of speech).
    Returns how long the pushing took (`seconds`, or more on a loaded machine)."""
    async def push() -> float:
        pcm, step = speech_like(seconds, 16_000, seed=2), 320
        t = time.monotonic()
        for k, i in enumerate(range(0, pcm.size, step)):
            session.push_audio(pcm[i:i + step], 16_000)
            await asyncio.sleep(max(0.0, t + (k + 1) * 0.02 - time.monotonic()))
        session.end_utterance()
        return time.monotonic() - t

    pushing = asyncio.ensure_future(push())
    want = int(seconds * float(session.fps))
    frames, loud, events = await listen(session, frames_wanted=want)
    pushing_s = await pushing
    assert "started" in events and "finished" in events, (session.id, events)
    assert frames >= want and loud >= want // 2, (session.id, frames, loud)
    return pushing_s


def test_the_replicas_and_their_workers_run_at_the_raylets_priority_not_rays_worker_niceness(fleet):
    """Ray starts its workers 15 nicer than the raylet: a live engine there lost the CPU to every other process
    on a loaded host (thousands of late frames on the H200 where a plain server had a few). The engine and
    front replicas, and what they start (WebRTC workers), run at the raylet's priority."""
    procs = processes()
    raylets = [pid for pid, (_, cmd) in procs.items() if "/raylet/raylet" in cmd or cmd.startswith("raylet")]
    replicas = [pid for pid, (_, cmd) in procs.items() if re.search(r"ray::ServeReplica:lipstream:(engine|front)", cmd)]
    assert raylets and len(replicas) >= 3, (raylets, replicas)  # two engines and the front
    children = [pid for pid, (ppid, _) in procs.items() if ppid in replicas]
    want = os.getpriority(os.PRIO_PROCESS, raylets[0])
    nice = {procs[pid][1][:60]: os.getpriority(os.PRIO_PROCESS, pid) for pid in replicas + children}
    assert set(nice.values()) == {want}, nice


def test_a_replica_killed_mid_job(fleet, root):
    """ray.kill of the replica running a job: the other replica takes the job once its lease expires and
    finishes it; the dead replica's live session ends (its speech socket closes, the client's iteration
    stops) while the other replica's goes on; Ray Serve starts a replacement."""
    import ray

    from lipstream.client import connect

    async def main():
        a = await connect(fleet, "anna", api_key=KEY, fps=25)
        b = await connect(fleet, "anna", api_key=KEY, fps=25)
        try:
            job = _submit(fleet, root / "long.wav")
            _wait_job(fleet, job["id"], lambda j: j["status"] == "running" and j["progress"] > 0.05,
                      what="running")
            store = _store(root)
            try:
                runner = store.get(job["id"]).runner_id
            finally:
                store.close()
            victim = runner.split("-", 1)[1]
            dead, alive = (a, b) if a.id.startswith(victim + ".") else (b, a)
            assert dead.id.startswith(victim + "."), (victim, a.id, b.id)
            ray.kill(ray.get_actor(f"SERVE_REPLICA::lipstream#engine#{victim}", namespace="serve"), no_restart=True)

            async def drained(session):
                async for _ in session:
                    pass

            await asyncio.wait_for(drained(dead), 60)  # its socket closed: iteration ends
            await speaks(alive)
            finished = await asyncio.to_thread(_wait_job, fleet, job["id"], lambda j: j["status"] == "done",
                                               240.0, "done")
            store = _store(root)
            try:
                row = store.get(job["id"])
            finally:
                store.close()
            assert row.attempts == 2 and row.runner_id != runner, row
            assert (finished["attempts"], finished["runner"]) == (2, row.runner_id), finished  # the API says so
            r = httpx.get(f"{fleet}{finished['result']}", headers=AUTH, timeout=60)
            assert r.status_code == 200 and len(r.content) > 1000
            listed = [x["id"] for x in httpx.get(f"{fleet}/v1/sessions", headers=AUTH, timeout=30).json()]
            assert dead.id not in listed and alive.id in listed
        finally:
            await a.aclose()
            await b.aclose()
        _wait_replicas(fleet, 2, without=victim)  # Ray Serve replaced the dead one

    asyncio.run(main())


def test_each_replica_asks_for_the_cpus_that_go_with_its_gpu():
    """Ray sets a replica's OMP_NUM_THREADS (torch's CPU threads) to the CPUs it asked for: one, by Ray's
    default, left a CPU fleet's jobs 1.5x as long as a plain server's."""
    from lipstream.serve.fleet.start import replica_cpus

    head, gpu_node = {"CPU": 64.0}, {"CPU": 16.0, "GPU": 2.0}
    assert replica_cpus([head, gpu_node], 1.0, 2) == 8.0  # the GPU node's share per GPU, not the cluster's
    assert replica_cpus([{"CPU": 16.0, "GPU": 1.0}], 1.0, 1) == 16.0
    assert replica_cpus([{"CPU": 2.0}], 0.0, 1) == 2.0 and replica_cpus([{"CPU": 2.0}], 0.0, 3) == 1.0


def test_merged_metrics_keep_every_family_parseable_with_counters_named_as_prometheus_writes_them():
    """The replicas' texts merged: a counter's HELP/TYPE carry its samples' `_total` name (else the parser
    leaves the family empty), a histogram keeps its buckets, the totals' sums come out as replica="all"."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from lipstream.serve.fleet.front import merged_metrics

    texts = {}
    for name, n in (("a", 2), ("b", 3)):
        r = CollectorRegistry()
        Counter("lipstream_things", "things done", registry=r).inc(n)
        Gauge("lipstream_live_sessions", "open live sessions", registry=r).set(n)
        Histogram("lipstream_pause_seconds", "pauses", registry=r, buckets=(0.1, 1.0)).observe(0.5)
        texts[name] = generate_latest(r).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged_metrics(texts))}
    things = {s.labels["replica"]: s.value for s in families["lipstream_things"].samples if s.name.endswith("_total")}
    assert things == {"a": 2.0, "b": 3.0}
    sessions = {s.labels["replica"]: s.value for s in families["lipstream_live_sessions"].samples}
    assert sessions == {"a": 2.0, "b": 3.0, "all": 5.0}
    buckets = [s for s in families["lipstream_pause_seconds"].samples if s.name.endswith("_bucket")]
    assert {(s.labels["replica"], s.labels["le"], s.value) for s in buckets} >= {("a", "1.0", 1.0), ("b", "0.1", 0.0)}
