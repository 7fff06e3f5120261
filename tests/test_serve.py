"""`lipstream serve`: the real server on loopback (uvicorn, tiny networks on the CPU), real HTTP clients.

One in-process server for the API's behaviour; a server in its own process for what only a process
shows (SIGTERM in the middle of a job, a restart that runs the queued ones).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import av
import httpx
import numpy as np
import pytest

from lipstream.cli import main
from lipstream.fixtures import speech_like, write_audio
from lipstream.fixtures.avatar import tracked_avatar

KEY = "test-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_models) -> Path:
    root = tmp_path_factory.mktemp("serve")
    tracked_avatar(root, "anna", tiny_models.vae, tiny_models.fingerprints["vae"], width=320, height=180, seed=0)
    write_audio(root / "hello.wav", speech_like(1.6, 16_000, seed=3), 16_000)
    write_audio(root / "long.wav", speech_like(6.0, 16_000, seed=4), 16_000)
    write_audio(root / "talk.wav", speech_like(4.0, 16_000, seed=5), 16_000)
    return root


@pytest.fixture(scope="module")
def server(root, tiny_models):
    """A started Service behind uvicorn on 127.0.0.1 (a free port), in this process."""
    import uvicorn

    from lipstream.serve.app import create_app
    from lipstream.serve.options import ServeOptions
    from lipstream.serve.service import Service

    options = ServeOptions(root / "avatars", root / "data", api_keys=(KEY,), max_upload_mb=0.5, max_audio_s=5.0,
                           jobs_per_key=2)
    service = Service(options, tiny_models).start()
    uv = uvicorn.Server(uvicorn.Config(create_app(service), host="127.0.0.1", port=0, log_config=None))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.05)
    port = uv.servers[0].sockets[0].getsockname()[1]
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        yield client, service
    uv.should_exit = True
    thread.join(30)


def _submit(client, audio: Path, avatar: str = "anna", headers=AUTH):
    with open(audio, "rb") as f:
        return client.post("/v1/jobs/render", data={"avatar": avatar}, files={"audio": (audio.name, f, "audio/wav")},
                           headers=headers)


def _events(client, job_id: str) -> list[dict]:
    out = []
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers=AUTH) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
    return out


def _frames(path: Path) -> list[np.ndarray]:
    with av.open(str(path)) as c:
        return [f.to_ndarray(format="yuv420p") for f in c.decode(video=0)]


def _audio(path: Path) -> np.ndarray:
    with av.open(str(path)) as c:
        return np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])


def test_health_ready_metrics_and_keys(server):
    client, _ = server
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json()["status"] == "ready"
    text = client.get("/metrics").text
    assert "lipstream_ready 1.0" in text and "lipstream_live_sessions" in text
    assert client.get("/v1/avatars").status_code == 401
    assert client.get("/v1/avatars", headers={"Authorization": "Bearer wrong-key-0123456789"}).status_code == 401
    avatars = client.get("/v1/avatars", headers=AUTH).json()
    assert [a["name"] for a in avatars] == ["anna"] and avatars[0]["width"] == 320
    assert client.get("/openapi.json").json()["paths"]["/v1/jobs/render"]


def test_bad_uploads_are_refused_before_any_job(server, root, tmp_path):
    client, service = server
    before = len(service.store.list())
    big = tmp_path / "big.wav"
    write_audio(big, speech_like(20.0, 16_000, seed=1), 16_000)  # 640 kB > 0.5 MB
    assert _submit(client, big).status_code == 413
    assert _submit(client, root / "long.wav").status_code == 413  # 6 s > 5 s
    assert _submit(client, root / "hello.wav", avatar="../avatars/anna").status_code == 422
    assert _submit(client, root / "hello.wav", avatar="bob").status_code == 404
    text = tmp_path / "notes.wav"
    text.write_text("not audio")
    assert _submit(client, text).status_code == 422
    assert _submit(client, root / "hello.wav", headers={}).status_code == 401
    assert len(service.store.list()) == before
    assert not [p for p in (root / "data" / "uploads").iterdir() if any(p.iterdir())]  # nothing kept


def test_a_render_job_equals_the_cli_render(server, root, tmp_path):
    """Upload, progress over SSE, the MP4 with Range; its frames are the CLI's for the same inputs."""
    client, _ = server
    r = _submit(client, root / "hello.wav")
    assert r.status_code == 202, r.text
    job = r.json()
    events = _events(client, job["id"])
    assert events[-1]["status"] == "done", events[-1]
    progress = [e["progress"] for e in events]
    assert progress == sorted(progress) and progress[-1] == 1.0
    url = events[-1]["result"]
    part = client.get(url, headers={**AUTH, "Range": "bytes=0-99"})
    assert part.status_code == 206 and len(part.content) == 100 and part.headers["content-range"].startswith("bytes 0-99/")
    served = tmp_path / "served.mp4"
    served.write_bytes(client.get(url, headers=AUTH).content)
    assert part.content == served.read_bytes()[:100]

    cli = tmp_path / "cli.mp4"
    assert main(["render", "--avatar", "anna", "--avatars", str(root / "avatars"), "--audio", str(root / "hello.wav"),
                 "-o", str(cli), "--random-weights", "--random-size", "tiny", "--device", "cpu"]) == 0
    a, b = _frames(served), _frames(cli)
    assert len(a) == len(b) == 16  # 1.6 s at 10 fps
    for x, y in zip(a, b):
        assert np.abs(x.astype(int) - y.astype(int)).mean() < 0.5  # the same frames, encoded alike
    np.testing.assert_allclose(_audio(served), _audio(cli), atol=1e-4)
    assert client.get("/v1/jobs", headers=AUTH).json()[0]["id"] == job["id"]


def test_a_broadcast_job_equals_the_cli_broadcast(server, root, tmp_path):
    """A script and the audio files it names; its MP4 is `lipstream broadcast`'s for the same inputs."""
    client, _ = server
    write_audio(tmp_path / "b.wav", speech_like(1.2, 16_000, seed=6), 16_000)
    (tmp_path / "a.wav").write_bytes((root / "hello.wav").read_bytes())
    script = tmp_path / "show.yaml"
    script.write_text("scenes:\n  - audio: a.wav\n    avatar: anna\n  - audio: b.wav\n    avatar: anna\n"
                      "    start_frame: 3\n")

    def submit(text: str, avatar_files=("a.wav", "b.wav")):
        files = [("script", ("show.yaml", text.encode(), "application/yaml"))]
        files += [("audio", (n, (tmp_path / n).read_bytes(), "audio/wav")) for n in avatar_files]
        return client.post("/v1/jobs/broadcast", files=files, headers=AUTH)

    assert submit(script.read_text().replace("b.wav", "../b.wav")).status_code == 422  # only the files sent
    assert submit(script.read_text().replace("avatar: anna\n    start", "avatar: zed\n    start")).status_code == 404
    assert submit(script.read_text(), ("a.wav",)).status_code == 422  # b.wav was not sent
    r = submit(script.read_text())
    assert r.status_code == 202, r.text
    done = _events(client, r.json()["id"])[-1]
    assert done["status"] == "done", done
    served = tmp_path / "served.mp4"
    served.write_bytes(client.get(done["result"], headers=AUTH).content)
    cli = tmp_path / "cli.mp4"
    assert main(["broadcast", str(script), "-o", str(cli), "--avatars", str(root / "avatars"), "--random-weights",
                 "--random-size", "tiny", "--device", "cpu"]) == 0
    a, b = _frames(served), _frames(cli)
    assert len(a) == len(b) == 28  # 1.6 s + 1.2 s at 10 fps
    assert max(np.abs(x.astype(int) - y.astype(int)).mean() for x, y in zip(a, b)) < 0.5


def test_a_compile_job_makes_a_resident_avatar(server, tmp_path):
    """An uploaded action loop becomes an avatar the next job can use, without a restart."""
    from lipstream.fixtures.avatar import action_loop

    client, service = server
    action_loop(tmp_path / "clip.mp4", width=640, height=360, seconds=0.6, fps=10, seed=4)

    def submit(name: str):
        with open(tmp_path / "clip.mp4", "rb") as f:
            return client.post("/v1/jobs/compile", data={"name": name}, files={"video": ("clip.mp4", f, "video/mp4")},
                               headers=AUTH)

    assert submit("../x").status_code == 422
    assert submit("anna").status_code == 409
    r = submit("ben")
    assert r.status_code == 202, r.text
    done = _events(client, r.json()["id"])[-1]
    assert done["status"] == "done", done
    avatar = client.get(done["result"], headers=AUTH).json()
    assert avatar["name"] == "ben" and (avatar["width"], avatar["height"]) == (640, 360)
    assert "ben" in [a["name"] for a in client.get("/v1/avatars", headers=AUTH).json()]
    with open(Path(service.o.data_dir).parent / "hello.wav", "rb") as f:
        job = client.post("/v1/jobs/render", data={"avatar": "ben"}, files={"audio": ("hello.wav", f, "audio/wav")},
                          headers=AUTH).json()
    assert _events(client, job["id"])[-1]["status"] == "done"


def test_cancel_and_the_per_key_cap(server, root):
    client, service = server
    first = _submit(client, root / "talk.wav").json()
    second = _submit(client, root / "talk.wav").json()
    third = _submit(client, root / "talk.wav")
    assert third.status_code == 429 and "Retry-After" in third.headers  # 2 queued or running
    for job in (second, first):
        assert client.delete(f"/v1/jobs/{job['id']}", headers=AUTH).status_code == 200
    for job in (first, second):
        assert _events(client, job["id"])[-1]["status"] == "cancelled"
        assert client.get(f"/v1/jobs/{job['id']}/result", headers=AUTH).status_code == 409
        assert not (root / "data" / "results" / f"{job['id']}.mp4").exists()
    assert not list((root / "data" / "results").glob(".*"))  # no half-written result left
    assert client.get("/v1/jobs/nope", headers=AUTH).status_code == 404


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(root: Path, data: Path, port: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p),
               LIPSTREAM_API_KEYS=KEY)
    with open(log, "ab") as f:  # a file, not a pipe: a pipe nobody reads would stall the server's logging
        return subprocess.Popen([sys.executable, "-m", "lipstream", "serve", "--avatars", str(root / "avatars"),
                                 "--data", str(data), "--port", str(port), "--random-weights", "--random-size",
                                 "tiny", "--device", "cpu"], env=env, stdout=subprocess.DEVNULL, stderr=f)


def _ready(client: httpx.Client, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            if client.get("/readyz").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not get ready")


def test_sigterm_mid_job_loses_nothing_and_a_restart_runs_it(root, tmp_path):
    data, port, log = tmp_path / "data", _free_port(), tmp_path / "server.log"
    proc = _start(root, data, port, log)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            _ready(client, proc, log)
            running = _submit(client, root / "talk.wav").json()
            queued = _submit(client, root / "hello.wav").json()
            t = time.monotonic()
            while client.get(f"/v1/jobs/{running['id']}", headers=AUTH).json()["progress"] == 0:
                assert time.monotonic() - t < 60
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        assert any(line.get("event") == "ready" for line in lines)  # JSON logs
        assert not list((data / "results").iterdir())  # nothing partial on disk
        proc = _start(root, data, port, log)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            _ready(client, proc, log)
            for job in (running, queued):
                assert _events(client, job["id"])[-1]["status"] == "done"
            frames = _frames_from(client, running["id"], tmp_path)
            assert len(frames) == 40  # 4 s at 10 fps, rendered again from the start
    finally:
        proc.terminate()
        proc.wait(60)


def _frames_from(client: httpx.Client, job_id: str, tmp_path: Path) -> list[np.ndarray]:
    path = tmp_path / f"{job_id}.mp4"
    path.write_bytes(client.get(f"/v1/jobs/{job_id}/result", headers=AUTH).content)
    return _frames(path)
