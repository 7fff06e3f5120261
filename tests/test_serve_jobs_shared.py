"""Two job runners on one store (issue 26, without Ray): two `Service`s in this process, each with its own
tiny LiveEngine and `runner_id`, sharing one data folder (so one SQLite job store, one uploads folder and one
results folder), both behind uvicorn on loopback. Jobs go to whichever runner is free, never to two at
once; a runner that dies mid-job loses its lease and the other finishes the job; a long job keeps its lease.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from pathlib import Path

import av
import httpx
import pytest

from lipstream.fixtures import speech_like, write_audio
from lipstream.fixtures.avatar import tracked_avatar
from lipstream.live import preset

pytestmark = pytest.mark.slow  # two services on one store, jobs run to the end: `make test` only

KEY = "test-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
LEASE_S = 1.0  # short, so that a dead runner's job is taken over within seconds


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_models) -> Path:
    root = tmp_path_factory.mktemp("shared")
    tracked_avatar(root, "anna", tiny_models.vae, tiny_models.fingerprints["vae"], width=320, height=180, seed=0)
    write_audio(root / "hello.wav", speech_like(1.6, 16_000, seed=3), 16_000)
    write_audio(root / "talk.wav", speech_like(4.0, 16_000, seed=5), 16_000)
    write_audio(root / "long.wav", speech_like(8.0, 16_000, seed=4), 16_000)
    return root


@pytest.fixture(scope="module")
def pair(root, tiny_models):
    """Runners "a" and "b": two started Services on one data folder (one jobs.sqlite3, one results folder),
    each behind its own uvicorn. Yields [(client, service)] * 2; both stopped (b first) at the end.
    Started once for the module (the last test kills a runner).
    Their live engines capture steps of 1, 2 and 4 frames, not up to 16: the start measures every step,
    30 s of the CPU's time at 16, 6 s at 4 (jobs go in steps of 4)."""
    import lipstream.serve.service as service_module
    from lipstream.serve.options import ServeOptions
    from lipstream.serve.server import in_thread
    from lipstream.serve.service import Service

    out = []
    with pytest.MonkeyPatch.context() as mp, ExitStack() as stack:
        mp.setattr(service_module, "preset", lambda name: preset(name).replace(buckets=(1, 2, 4)))
        for name in ("a", "b"):
            options = ServeOptions(root / "avatars", root / "data", api_keys=(KEY,), jobs_per_key=8,
                                   live_capacity_fps=35.0, rtc_workers=1, runner_id=name, lease_s=LEASE_S)
            service = Service(options, tiny_models).start()
            url = stack.enter_context(in_thread(service))
            out.append((stack.enter_context(httpx.Client(base_url=url, timeout=60)), service))
        yield out


def _submit(client: httpx.Client, audio: Path) -> dict:
    with open(audio, "rb") as f:
        r = client.post("/v1/jobs/render", data={"avatar": "anna"}, files={"audio": (audio.name, f, "audio/wav")},
                        headers=AUTH)
    assert r.status_code == 202, r.text
    return r.json()


def _wait(service, job_id: str, until, timeout: float = 60.0, what: str = ""):
    """The job once `until(job)` holds (read from the store every 20 ms)."""
    t = time.monotonic()
    while True:
        job = service.store.get(job_id)
        if until(job):
            return job
        assert time.monotonic() - t < timeout, f"job {job_id} never {what}: {job}"
        time.sleep(0.02)


def _frames(path: Path) -> int:
    with av.open(str(path)) as c:
        return sum(1 for _ in c.decode(video=0))


def _served(client: httpx.Client, job_id: str, tmp_path: Path) -> Path:
    r = client.get(f"/v1/jobs/{job_id}/result", headers=AUTH)
    assert r.status_code == 200, r.text
    path = tmp_path / f"served-{job_id}.mp4"
    path.write_bytes(r.content)
    return path


def _jobs_done(service) -> float:
    return service.metrics.registry.get_sample_value("lipstream_job_seconds_count") or 0.0


def _only_finished_results(service) -> None:
    """The shared results folder holds the finished results and nothing else (no half or lost output)."""
    done = {Path(j.result).name for j in service.store.list() if j.status == "done"}
    assert {p.name for p in (service.o.data_dir / "results").iterdir()} == done


def test_two_runners_share_one_queue_and_run_each_job_once(pair, root, tmp_path):
    (ca, a), (cb, b) = pair
    done_a, done_b = _jobs_done(a), _jobs_done(b)
    ids = [_submit(ca, root / "hello.wav")["id"] for _ in range(4)]  # all through runner a's API
    jobs = [_wait(a, i, lambda j: j.status not in ("queued", "running"), what="ended") for i in ids]
    assert [j.status for j in jobs] == ["done"] * 4, [(j.status, j.error) for j in jobs]
    assert [j.attempts for j in jobs] == [1] * 4  # each claimed once: never run twice
    assert {j.runner_id for j in jobs} == {"a", "b"}  # both runners took some
    ran_a, ran_b = _jobs_done(a) - done_a, _jobs_done(b) - done_b  # each server's own counter
    assert ran_a == sum(j.runner_id == "a" for j in jobs) >= 1 and ran_b == sum(j.runner_id == "b" for j in jobs) >= 1
    results = {j.result for j in jobs}
    assert len(results) == 4 and all(r.startswith("results/") for r in results)
    for job in jobs:
        for client in (ca, cb):  # either server serves any result (one results folder)
            assert _frames(_served(client, job.id, tmp_path)) == 16  # 1.6 s at 10 fps
    _only_finished_results(a)


def test_a_job_longer_than_its_lease_keeps_it(pair, root, tmp_path):
    """The heartbeat renews the lease: a job running for several leases is never taken by the idle runner,
    and a server starting beside it (its start sweeps the shared folders) leaves its half-written MP4 alone."""
    (ca, a), (cb, b) = pair
    job = _submit(ca, root / "long.wav")
    running = _wait(a, job["id"], lambda j: j.status == "running", what="started")
    holder, idle = (a, b) if running.runner_id == "a" else (b, a)
    done_holder, done_idle = _jobs_done(holder), _jobs_done(idle)
    seen = set()
    while (current := idle.store.get(job["id"])).status == "running":
        seen.add((current.runner_id, current.attempts))
        if time.time() - current.started_at > 1.5 * LEASE_S:
            idle._sweep()  # what a server starting on the same data folder does
        time.sleep(0.05)
    assert current.status == "done", current.error
    assert current.finished_at - current.started_at > 2 * LEASE_S  # it did outlive its lease, more than once
    assert seen == {(holder.o.runner_id, 1)} and current.attempts == 1 and current.runner_id == holder.o.runner_id
    assert _jobs_done(holder) == done_holder + 1 and _jobs_done(idle) == done_idle
    assert _frames(_served(ca, job["id"], tmp_path)) == 80  # 8 s at 10 fps
    _only_finished_results(a)


def test_a_runner_that_dies_mid_job_loses_it_to_the_other(pair, root, tmp_path, caplog):
    """(Last: the killed runner stays dead.) Kill the runner of a running job (its heartbeat and worker
    stop; nothing is finished or requeued): after its lease the other runner requeues the job and finishes it. When the dead runner's worker comes
    back, the store refuses what it tries (its progress, its finish): it stops, and its output is never served."""
    (ca, a), (cb, b) = pair
    job = _submit(ca, root / "talk.wav")
    running = _wait(a, job["id"], lambda j: j.status == "running" and j.progress > 0, what="made progress")
    dead, alive = (a, b) if running.runner_id == "a" else (b, a)
    done_dead, done_alive = _jobs_done(dead), _jobs_done(alive)
    dead.runner.kill()
    time.sleep(0.1)  # a renewal under way when it was killed has landed
    lease = alive.store.get(job["id"]).lease_until
    done = _wait(alive, job["id"], lambda j: j.status in ("done", "failed"), timeout=90, what="finished")
    assert done.status == "done", done.error
    assert done.started_at > lease  # taken only once the dead runner's lease had run out
    assert done.attempts == 2 and done.runner_id == alive.o.runner_id  # claimed again, by the other
    served = alive.o.data_dir / done.result
    before = served.read_bytes(), served.stat().st_ino
    assert _frames(served) == 40  # 4 s at 10 fps, rendered again from the start

    caplog.set_level("WARNING", logger="lipstream.serve.jobs")
    dead.runner.unfreeze()  # the dead runner's worker wakes up, its heartbeat still dead, and goes on
    dead.runner._thread.join(60)
    assert not dead.runner._thread.is_alive()
    assert any(job["id"] in r.getMessage() and "another runner" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="held by runner|is done"):  # what the store tells the woken runner
        dead.store.finish(job["id"], "results/zombie.mp4")
    after = dead.store.get(job["id"])
    assert (after.status, after.result, after.runner_id, after.attempts) == ("done", done.result, done.runner_id, 2)
    assert (served.read_bytes(), served.stat().st_ino) == before  # untouched (not even replaced by equal bytes)
    _only_finished_results(a)  # nothing half-written or written twice
    for client in (ca, cb):
        assert _frames(_served(client, job["id"], tmp_path)) == 40
    assert _jobs_done(dead) == done_dead and _jobs_done(alive) == done_alive + 1
