"""What a hostile user can hand LipStream: scripts built to explode (YAML alias bombs), scripts that say one
thing twice, huge names, uploads that are not audio, and another key's jobs. Each is refused in one line, in
seconds, without the server's own folders in the answer, and the server keeps answering meanwhile.

The CLI runs in a fresh interpreter (with a memory ceiling, so a regression fails instead of swapping the
machine); the server is `lipstream serve` in its own process with two keys.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from lipstream.errors import InputError
from lipstream.fixtures import speech_like, write_audio
from serve_process import serve_process

SRC = str(Path(__file__).resolve().parents[1] / "src")
KEY_A = "hostile-key-a-0123456789abcdef"
KEY_B = "hostile-key-b-0123456789abcdef"
LOCAL = ["--random-weights", "--random-size", "tiny", "--device", "cpu"]


def bomb_script(levels: int, avatar: str = "p") -> str:
    """A broadcast script whose one scene's `avatar:` is nested anchors: 10 ** levels items once expanded, in
    a few hundred bytes (every key is an allowed one)."""
    inner = "&a0 [" + ", ".join([avatar] * 10) + "]"
    for k in range(1, levels):
        inner = f"&a{k} [{inner}, " + ", ".join([f"*a{k - 1}"] * 9) + "]"
    return f"scenes:\n  - audio: hello.wav\n    avatar: {inner}\n"


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    path = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)
    threads = {k: v for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TMPDIR") if (v := os.environ.get(k))}
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
            "COLUMNS": "200", "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", **threads, **(extra or {})}


def _memory_ceiling() -> None:
    """The CLI's process may not take more than 3 GiB of address space: an expanding bomb dies, not the machine."""
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))


def cli(args: list, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, str]:
    """The real CLI in a fresh interpreter: (exit status, stderr)."""
    p = subprocess.run([sys.executable, "-m", "lipstream", *map(str, args)], cwd=cwd, capture_output=True,
                       text=True, timeout=timeout, env=_env(env), preexec_fn=_memory_ceiling)
    return p.returncode, p.stderr


@pytest.fixture(scope="module")
def desk(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("desk")
    write_audio(root / "hello.wav", speech_like(1.0, 16_000, seed=3), 16_000)
    nan = speech_like(1.0, 16_000, seed=1)
    nan[8000] = np.nan  # its header reads (the upload is taken), its samples are refused when the job runs
    write_audio(root / "damaged.wav", nan, 16_000, codec="pcm_f32le")
    (root / "empty.wav").write_bytes(b"")
    (root / "notes.wav").write_text("not audio at all, just words in a file named .wav\n" * 20)
    return root


# -- scripts, read by the CLI ------------------------------------------------------------------------------

@pytest.mark.parametrize("levels", [9, 6], ids=["1e9-items", "1e6-items"])
def test_a_yaml_bomb_in_a_scene_is_one_line_in_seconds(desk, tmp_path, levels):
    """514 bytes standing for 10^9 avatars (or 10^6, which once ended in a 7 MB "File name too long" line):
    `lipstream broadcast` refuses it in one line naming the file, before anything loads."""
    script = tmp_path / "bomb.yaml"
    script.write_text(bomb_script(levels))
    assert script.stat().st_size < 1000
    (tmp_path / "hello.wav").write_bytes((desk / "hello.wav").read_bytes())
    code, stderr = cli(["broadcast", script, "-o", tmp_path / "out.mp4", "--avatars", tmp_path], tmp_path,
                       timeout=60)
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1, stderr[:2000]
    assert lines[0].startswith(f"error: {script}: line 3:") and "aliases" in lines[0], lines[0][:2000]
    assert len(lines[0]) < 400
    assert not (tmp_path / "out.mp4").exists()


def _load(tmp_path: Path, text: str):
    from lipstream.render.script import load_script

    path = tmp_path / "show.yaml"
    path.write_text(text)
    return load_script(path)


def test_a_key_given_twice_is_refused_naming_it_and_its_line(tmp_path):
    with pytest.raises(InputError, match=r"line 4: key 'audio' appears twice in one mapping \(first on line 2\)"):
        _load(tmp_path, "scenes:\n  - audio: a.wav\n    avatar: p\n    audio: b.wav\n")
    with pytest.raises(InputError, match=r"line 1: key 'fps' appears twice"):
        _load(tmp_path, "{fps: 25, fps: 30, scenes: [{audio: a.wav, avatar: p}]}\n")
    # a merge (<<) may still be overridden by the mapping's own key, as YAML says
    program = _load(tmp_path, "scenes:\n  - &b {avatar: p, audio: a.wav}\n  - <<: *b\n    audio: c.wav\n")
    assert [s.audio.name for s in program.scenes] == ["a.wav", "c.wav"]


@pytest.mark.parametrize("value, fragment", [
    ("[" + ", ".join(["p"] * 50_000) + "]", "avatar must be a file name, got a list"),
    ("a" * 300, "avatar: a name of 300 characters; a file name of at most 255"),
    ("a" * 70_000, "a value of 70000 characters; at most 65536 are allowed"),
])
def test_a_huge_name_never_reaches_the_filesystem(tmp_path, value, fragment):
    """An avatar's name is a name: a list (within the size bound) or a name longer than a file system takes is
    one short line, never an OSError from a system call."""
    with pytest.raises(InputError) as caught:
        _load(tmp_path, f"scenes:\n  - audio: a.wav\n    avatar: {value}\n")
    assert fragment in str(caught.value) and len(str(caught.value)) < 400, str(caught.value)[:500]


def test_a_script_over_one_mebibyte_is_refused_unread(tmp_path):
    text = "scenes:\n  - {audio: a.wav, avatar: p}\n" + "# padding\n" * 120_000
    with pytest.raises(InputError, match="a script of at most 1048576 bytes"):
        _load(tmp_path, text)


def test_a_script_of_too_many_scenes_is_refused(tmp_path):
    scenes = "".join("  - {audio: a.wav, avatar: p}\n" for _ in range(501))
    with pytest.raises(InputError, match="501 scenes; a script of at most 500 is allowed"):
        _load(tmp_path, "scenes:\n" + scenes)


# -- the server ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory, presenter):
    """`lipstream serve` in its own process with two keys, the presenter `p` resident: (URL, data folder)."""
    work = tmp_path_factory.mktemp("hostile-server")
    data = work / "data"
    with serve_process(["--avatars", presenter.parent, "--data", data, *LOCAL],
                       _env({"LIPSTREAM_API_KEYS": f"{KEY_A},{KEY_B}"}), work / "server.log") as url:
        yield url, data


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _wait(url: str, job_id: str, key: str = KEY_A, limit_s: float = 120) -> dict:
    t = time.monotonic()
    while True:
        job = httpx.get(f"{url}/v1/jobs/{job_id}", headers=_auth(key)).json()
        if job["status"] in ("done", "failed", "cancelled"):
            return job
        assert time.monotonic() - t < limit_s, job
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("levels", [9, 6], ids=["1e9-items", "1e6-items"])
def test_a_yaml_bomb_posted_is_422_and_the_server_keeps_answering(server, desk, levels):
    url, data = server
    answer: dict = {}

    def post():
        try:
            answer["r"] = httpx.post(f"{url}/v1/jobs/broadcast", headers=_auth(KEY_A), timeout=30,
                                     files=[("script", ("show.yaml", bomb_script(levels).encode(), "application/yaml")),
                                            ("audio", ("hello.wav", (desk / "hello.wav").read_bytes(), "audio/wav"))])
        except httpx.HTTPError as e:
            answer["r"] = e

    poster = threading.Thread(target=post)
    poster.start()
    probes = 0
    while poster.is_alive() or probes == 0:
        assert httpx.get(f"{url}/readyz", timeout=5).status_code == 200  # the event loop is never held
        probes += 1
        time.sleep(0.05)
    poster.join()
    r = answer["r"]
    assert isinstance(r, httpx.Response), r
    assert r.status_code == 422, r.text[:500]
    detail = r.json()["detail"]
    assert detail.startswith("script: show.yaml: line 3:") and "aliases" in detail and "\n" not in detail, detail
    assert len(r.text) < 500 and str(data) not in r.text


@pytest.mark.slow
def test_a_key_given_twice_in_a_posted_script_is_422(server, desk):
    url, _ = server
    r = httpx.post(f"{url}/v1/jobs/broadcast", headers=_auth(KEY_A),
                   files=[("script", ("show.yaml", b"scenes:\n  - audio: hello.wav\n    audio: hello.wav\n"
                                                   b"    avatar: p\n", "application/yaml")),
                          ("audio", ("hello.wav", (desk / "hello.wav").read_bytes(), "audio/wav"))])
    assert r.status_code == 422, r.text
    assert r.json()["detail"] == ("script: show.yaml: line 3: key 'audio' appears twice in one mapping "
                                  "(first on line 2); each key is allowed once")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["empty.wav", "notes.wav"])
def test_a_refused_upload_names_the_field_not_the_servers_folders(server, desk, name):
    url, data = server
    r = httpx.post(f"{url}/v1/jobs/render", headers=_auth(KEY_A), data={"avatar": "p"},
                   files={"audio": (name, (desk / name).read_bytes(), "audio/wav")})
    assert r.status_code == 422, r.text
    assert r.json()["detail"].startswith("audio: "), r.text
    for folder in {str(data), str(data.resolve()), "uploads/"}:
        assert folder not in r.text, r.text


@pytest.mark.slow
def test_a_job_that_fails_on_the_server_shows_none_of_its_folders(server, desk, tmp_path):
    """The job's error, its events and `render --server`'s line name the file as sent, not where the server
    keeps it."""
    url, data = server
    code, stderr = cli(["render", "--server", url, "--avatar", "p", "--audio", desk / "damaged.wav",
                        "-o", tmp_path / "out.mp4"], desk, {"LIPSTREAM_API_KEY": KEY_A}, timeout=300)
    last = stderr.strip().splitlines()[-1]
    assert code == 1 and last.startswith(f"error: the job failed on the server at {url}"), stderr
    assert "damaged.wav" in last or "audio" in last, last
    jobs = httpx.get(f"{url}/v1/jobs", headers=_auth(KEY_A)).json()
    failed = next(j for j in jobs if j["status"] == "failed")
    with httpx.stream("GET", f"{url}/v1/jobs/{failed['id']}/events", headers=_auth(KEY_A)) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    seen = stderr + json.dumps(jobs) + "\n".join(events)
    assert failed["error"], failed
    for folder in {str(data), str(data.resolve()), "uploads/"}:
        assert folder not in seen, seen


@pytest.mark.slow
def test_another_keys_jobs_and_uploads_are_not_there(server, desk):
    """Key B cannot list, read, follow, download, cancel or delete key A's job, nor name its uploads: every
    such call is 404, as for a job that does not exist (a 403 would say it does)."""
    url, data = server
    r = httpx.post(f"{url}/v1/jobs/render", headers=_auth(KEY_A), data={"avatar": "p"},
                   files={"audio": ("hello.wav", (desk / "hello.wav").read_bytes(), "audio/wav")})
    assert r.status_code == 202, r.text
    job = _wait(url, r.json()["id"])
    assert job["status"] == "done", job
    a, b = _auth(KEY_A), _auth(KEY_B)
    assert job["id"] not in [j["id"] for j in httpx.get(f"{url}/v1/jobs", headers=b).json()]
    assert httpx.get(f"{url}/v1/jobs/{job['id']}/result", headers=a).status_code == 200
    for method, path, extra in [("GET", "", {}), ("GET", "/events", {}), ("GET", "/result", {}),
                                ("GET", "/result", {"params": {"token": KEY_B}}), ("DELETE", "", {})]:
        r = httpx.request(method, f"{url}/v1/jobs/{job['id']}{path}", headers=b if not extra else {}, **extra)
        assert r.status_code == 404, (method, path, r.status_code, r.text)
    assert httpx.get(f"{url}/v1/jobs/{job['id']}", headers=a).json()["status"] == "done"  # B's delete did nothing
    # uploads: a script names files as sent with it, never another job's (its audio lives in A's upload folder)
    uploads = sorted(p for p in (data / "uploads").rglob("*.wav"))
    assert uploads
    for name in (str(uploads[0]), f"../{uploads[0].parent.name}/{uploads[0].name}"):
        script = f"scenes:\n  - audio: {json.dumps(name)}\n    avatar: p\n".encode()
        r = httpx.post(f"{url}/v1/jobs/broadcast", headers=b,
                       files=[("script", ("show.yaml", script, "application/yaml")),
                              ("audio", ("mine.wav", (desk / "hello.wav").read_bytes(), "audio/wav"))])
        assert r.status_code == 422 and "must be one of the files sent" in r.text, r.text
        assert str(data) not in r.text


@pytest.mark.slow
def test_text_scenes_count_against_the_audio_limit(server):
    """A script of text alone is spoken on the server: ~11 minutes of words is past the default 600 s, refused
    before it is queued, as the same length of audio would be."""
    url, _ = server
    words = "markets closed higher today " * 360  # 10,080 characters: ~670 s at 15 a second
    script = f"scenes:\n  - avatar: p\n    text: {json.dumps(words)}\n".encode()
    before = len(httpx.get(f"{url}/v1/jobs", headers=_auth(KEY_B)).json())
    r = httpx.post(f"{url}/v1/jobs/broadcast", headers=_auth(KEY_B),
                   files=[("script", ("show.yaml", script, "application/yaml"))])
    assert r.status_code == 413, r.text
    assert "of text scenes" in r.json()["detail"] and "at most 600 s" in r.json()["detail"], r.text
    assert len(httpx.get(f"{url}/v1/jobs", headers=_auth(KEY_B)).json()) == before
