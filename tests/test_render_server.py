"""`lipstream render | broadcast --server URL`: the CLI (a fresh interpreter each time) against a real
`lipstream serve` in its own process on loopback (tiny random networks, conftest's presenter), no mocks.

One server for the module. Each remote render is compared with a local render of the same inputs and
options. The criterion is every decoded picture within 1 code value, with --crf 0 on both sides (x264's
lossless mode), so the comparison is of the engine's frames: the server's live lane batches frames
differently from the CLI's engine. At the default crf 18, two *local* renders of the same inputs already
differ by up to 6 code values here (x264's threads do not give the same bitstream every run), so a lossy
comparison could only be test_serve's PSNR > 40 dB.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import av
import httpx
import numpy as np
import pytest

from lipstream.cli import main
from lipstream.fixtures import speech_like, write_audio
from serve_process import free_port, serve_process

pytestmark = pytest.mark.slow  # a `lipstream serve` in a process of its own: `make test` only

KEY = "render-server-key-0123456789"
OTHER_KEY = "render-server-key-other-0123"  # a second caller: its jobs count against its own cap
SRC = str(Path(__file__).resolve().parents[1] / "src")
PROBE = ("import sys; from lipstream.cli import main; code = main(sys.argv[1:]); "
         "print('torch-imported' if 'torch' in sys.modules else 'torch-not-imported'); sys.exit(code)")
LOCAL = ["--random-weights", "--random-size", "tiny", "--device", "cpu"]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A clean environment (no LIPSTREAM_SERVER or key of the developer's), this checkout's package first."""
    path = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)
    # the caller's thread counts go along: a CPU server of every core's threads beside a loaded suite's
    # workers (the GPU image's, 12 of them) spun in OpenMP's barriers and was not ready in 180 s
    threads = {k: v for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TMPDIR") if (v := os.environ.get(k))}
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
            "COLUMNS": "200", "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", **threads, **(extra or {})}


def cli(args: list, cwd: Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """The real CLI in a fresh interpreter; stdout ends with whether torch was imported."""
    p = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                       timeout=300, env=_env(env))
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def desk(tmp_path_factory) -> Path:
    """Speech files (one in a sub-folder, as scripts name them), a damaged one, and text posing as audio."""
    root = tmp_path_factory.mktemp("desk")
    write_audio(root / "hello.wav", speech_like(1.6, 16_000, seed=3), 16_000)
    (root / "sounds").mkdir()
    write_audio(root / "sounds" / "story.wav", speech_like(1.2, 16_000, seed=6), 16_000)
    write_audio(root / "long.wav", speech_like(4.0, 16_000, seed=5), 16_000)
    nan = speech_like(1.0, 16_000, seed=1)
    nan[8000] = np.nan  # a damaged float WAV: its header reads, its samples are refused when the job decodes it
    write_audio(root / "damaged.wav", nan, 16_000, codec="pcm_f32le")
    (root / "notes.wav").write_text("not audio at all")
    (root / "folder.wav").mkdir()
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory, presenter):
    """`lipstream serve` in its own process with two keys, the presenter resident: its URL."""
    data = tmp_path_factory.mktemp("server")
    with serve_process(["--avatars", presenter.parent, "--data", data / "data", "--jobs-per-key", "2", *LOCAL],
                       _env({"LIPSTREAM_API_KEYS": f"{KEY},{OTHER_KEY}"}), data / "server.log") as url:
        yield url


def _jobs(url: str, key: str = KEY) -> list[dict]:
    return httpx.get(f"{url}/v1/jobs", headers={"Authorization": f"Bearer {key}"}).json()


def _frames(path: Path) -> list[np.ndarray]:
    with av.open(str(path)) as c:
        return [f.to_ndarray(format="yuv420p") for f in c.decode(video=0)]


def _audio(path: Path) -> np.ndarray:
    with av.open(str(path)) as c:
        return np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])


def _max_difference(a: list[np.ndarray], b: list[np.ndarray]) -> int:
    assert len(a) == len(b)
    return max(int(np.abs(x.astype(np.int16) - y.astype(np.int16)).max()) for x, y in zip(a, b))


def _job_id(stderr: str) -> str:
    return re.search(r"job ([0-9a-f]{16,}) \(", stderr).group(1)


def test_render_on_the_server_is_the_local_render(server, desk, presenter, tmp_path):
    """--server URL with the key from $LIPSTREAM_API_KEY: progress lines, the MP4 in place (nothing else in
    its folder), no torch in the client; the frames are a local render's of the same inputs and options."""
    out = tmp_path / "out"
    out.mkdir()
    code, stdout, stderr = cli(["render", "--server", server, "--avatar", "p", "--audio", desk / "hello.wav",
                                "-o", out / "remote.mp4", "--crf", "0", "--start-frame", "2"], desk,
                               {"LIPSTREAM_API_KEY": KEY})
    assert code == 0, stderr
    assert "torch-not-imported" in stdout  # the remote path is an HTTP client
    assert re.search(r"job \w+ \(render\) queued", stderr) and re.search(r"job \w+ \(render\) done 100%", stderr)
    assert "uploading 1 file" in stderr and "wrote" in stdout and "16 frames at 10 fps" in stdout, stdout
    assert os.listdir(out) == ["remote.mp4"]
    job = httpx.get(f"{server}/v1/jobs/{_job_id(stderr)}", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert job["options"] == {"crf": 0, "start_frame": 2}  # the options went with the job

    local = tmp_path / "local.mp4"
    assert main(["render", "--avatar", "p", "--avatars", str(presenter.parent), "--audio", str(desk / "hello.wav"),
                 "-o", str(local), "--crf", "0", "--start-frame", "2", *LOCAL]) == 0
    remote, here = _frames(out / "remote.mp4"), _frames(local)
    assert len(remote) == len(here) == 16  # 1.6 s at 10 fps
    worst = _max_difference(remote, here)
    print(f"render --server vs local, --crf 0: max difference {worst} code values over {len(remote)} frames")
    assert worst <= 1
    np.testing.assert_allclose(_audio(out / "remote.mp4"), _audio(local), atol=1e-4)


def test_broadcast_on_the_server_is_the_local_broadcast(server, desk, presenter, tmp_path):
    """A 2-scene script (audio in a sub-folder, a start frame, a crossfade, its own avatars folder) with the
    server from $LIPSTREAM_SERVER and the key from --api-key; --fps 5 and --crf 0 go with the job."""
    script = desk / "show.yaml"
    script.write_text(f"avatars: {presenter.parent}\nscenes:\n  - {{avatar: p, audio: hello.wav}}\n"
                      "  - avatar: p\n    audio: sounds/story.wav\n    start_frame: 3\n"
                      "    transition: {crossfade: 3}\n")
    remote = tmp_path / "remote.mp4"
    code, stdout, stderr = cli(["broadcast", script, "-o", remote, "--api-key", KEY, "--fps", "5", "--crf", "0"],
                               desk, {"LIPSTREAM_SERVER": server})
    assert code == 0, stderr
    assert "torch-not-imported" in stdout and "uploading 3 files" in stderr
    assert "not used with --server" in stderr  # the script's avatars folder: the server has its own
    assert re.search(r"job \w+ \(broadcast\) done 100%", stderr), stderr
    assert os.listdir(tmp_path) == ["remote.mp4"]
    local = tmp_path / "local.mp4"
    assert main(["broadcast", str(script), "-o", str(local), "--fps", "5", "--crf", "0", *LOCAL]) == 0
    a, b = _frames(remote), _frames(local)
    assert len(a) == len(b) == 14  # 1.6 s + 1.2 s at 5 fps
    worst = _max_difference(a, b)
    print(f"broadcast --server vs local, --crf 0: max difference {worst} code values over {len(a)} frames")
    assert worst <= 1
    np.testing.assert_allclose(_audio(remote), _audio(local), atol=1e-4)


def _closed_port() -> int:
    return free_port()  # nothing listens there once the probe socket is closed


# (name, args after `render`, environment, exit code, fragments of the one line, is it refused before any upload)
RENDER = ["--avatar", "p", "--audio", "hello.wav"]
ERRORS = [
    ("unknown-avatar", ["--avatar", "zed", "--audio", "hello.wav"], {"LIPSTREAM_API_KEY": KEY}, 1,
     ["zed: unknown avatar: not on the server at {url}", "it has: p"], True),
    ("avatar-as-a-folder", ["--avatar", "avatars/p", "--audio", "hello.wav"], {"LIPSTREAM_API_KEY": KEY}, 1,
     ["unknown avatar", "named, not a folder"], True),
    ("missing-audio", ["--avatar", "p", "--audio", "missing.wav"], {"LIPSTREAM_API_KEY": KEY}, 1,
     ["missing.wav: no such audio file"], True),
    ("audio-is-a-folder", ["--avatar", "p", "--audio", "folder.wav"], {"LIPSTREAM_API_KEY": KEY}, 1,
     ["folder.wav: is a folder"], True),
    ("unreadable-audio", ["--avatar", "p", "--audio", "notes.wav"], {"LIPSTREAM_API_KEY": KEY}, 1,
     ["notes.wav: not a readable audio or video file"], True),
    ("no-such-output-folder", RENDER + ["-o", "no/such/dir/out.mp4"], {"LIPSTREAM_API_KEY": KEY}, 1,
     ["output folder no/such/dir does not exist"], True),
    ("no-key", RENDER, {}, 1,
     ["error: {url} answered 401: it wants an API key: pass --api-key KEY (or set LIPSTREAM_API_KEY)"], True),
    ("wrong-key", RENDER, {"LIPSTREAM_API_KEY": "not-the-key-0123456789"}, 1,
     ["error: {url} answered 401: it refused the API key given (not one of its keys): pass --api-key KEY (or set "
      "LIPSTREAM_API_KEY)"], True),
    ("job-fails-on-the-server", ["--avatar", "p", "--audio", "damaged.wav"], {"LIPSTREAM_API_KEY": KEY}, 1,
     ["the job failed on the server at {url}", "NaN or infinite samples"], False),
    ("bad-server-address", RENDER + ["--server", "127.0.0.1:8000"], {}, 2,
     ["--server '127.0.0.1:8000'", "http://HOST:PORT"], True),
] + [(f"local-only-{flag.strip('-')}", RENDER + [flag, *value], {"LIPSTREAM_API_KEY": KEY}, 2,
      [f"{flag}: not with --server"], True)
     for flag, value in [("--device", ["cpu"]), ("--batch", ["4"]), ("--encoders", ["2"]), ("--random-weights", []),
                         ("--random-size", ["tiny"]), ("--models", ["models"]), ("--reference", []),
                         ("--decode-rows", ["full"]), ("--timings", []), ("--avatars", ["avatars"])]] + [
    ("local-only-compile", RENDER + ["--no-compile"], {"LIPSTREAM_API_KEY": KEY}, 2,
     ["--compile/--no-compile: not with --server"], True),
]


@pytest.mark.parametrize("name, args, env, expected, fragments, early", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_are_one_line_and_leave_nothing(server, desk, tmp_path, name, args, env, expected, fragments, early):
    """Each mistake: one line, a non-zero exit, nothing in the output's folder; the ones a client can see
    are refused before anything is uploaded (the server holds no new job) and before torch is imported."""
    out = tmp_path / "out"
    out.mkdir()
    before = len(_jobs(server))
    args = ["render", *args] + ([] if "-o" in args else ["-o", out / "out.mp4"])
    args += [] if "--server" in args else ["--server", server]
    code, stdout, stderr = cli(args, desk, env)
    lines = stderr.strip().splitlines()
    assert code == expected, stderr
    assert len(lines) == 1 and lines[0].startswith("error:") or (not early and lines[-1].startswith("error:")), stderr
    for fragment in fragments:
        assert fragment.format(url=server) in lines[-1], lines[-1]
    assert os.listdir(out) == []
    assert "torch-not-imported" in stdout
    if early:
        assert len(_jobs(server)) == before  # nothing reached the server's queue


def test_an_unreachable_server_is_one_line(desk, tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}"
    code, stdout, stderr = cli(["render", "--server", url, *RENDER, "-o", tmp_path / "out.mp4"], desk,
                               {"LIPSTREAM_API_KEY": KEY})
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1, stderr
    assert lines[0].startswith(f"error: cannot reach the server at {url}: ") and "refused" in lines[0], lines[0]
    assert os.listdir(tmp_path) == [] and "torch-not-imported" in stdout


@pytest.mark.parametrize("key", [None, "not-the-key-0123456789"])
def test_broadcast_and_serve_bench_without_the_key_say_how_to_give_it_in_one_line(server, desk, tmp_path, key):
    """A server with keys answers 401 to a caller without one (or with another): `broadcast --server` and
    `serve-bench` say so in one line naming where the key goes, and leave no output, no job, no report."""
    (tmp_path / "show.yaml").write_text(f"scenes:\n  - audio: {desk / 'hello.wav'}\n    cameras:\n"
                                        "      - {at: 0, avatar: p}\n")
    given = "it refused the API key given (not one of its keys)" if key else "it wants an API key"
    before = len(_jobs(server))
    code, stdout, stderr = cli(["broadcast", tmp_path / "show.yaml", "-o", tmp_path / "out.mp4", "--server", server],
                               desk, {"LIPSTREAM_API_KEY": key} if key else {})
    assert code == 1 and stderr.strip().splitlines() == [
        f"error: {server} answered 401: {given}: pass --api-key KEY (or set LIPSTREAM_API_KEY)"], stderr
    code, stdout, stderr = cli(["serve-bench", "--url", server, "--sessions", "1", "-o", tmp_path / "report"], desk,
                               {"LIPSTREAM_API_KEYS": key} if key else {})
    assert code == 1 and stderr.strip().splitlines() == [
        f"error: {server} answered 401: {given}: set LIPSTREAM_API_KEYS=KEY (serve-bench sends the first key "
        "listed)"], stderr
    assert "torch-not-imported" in stdout
    assert sorted(os.listdir(tmp_path)) == ["show.yaml"] and len(_jobs(server)) == before


def test_the_server_and_key_variables_and_the_flag_over_them(server, desk, tmp_path):
    """$LIPSTREAM_SERVER and $LIPSTREAM_API_KEY are used when the flags are absent; --server wins over the
    variable; --server '' renders here (the local path's own error: its avatars folder is not there)."""
    out = tmp_path / "out.mp4"
    args = ["render", "--avatar", "zed", "--audio", "hello.wav", "-o", out]
    dead = f"http://127.0.0.1:{_closed_port()}"
    code, _, stderr = cli(args, desk, {"LIPSTREAM_SERVER": server, "LIPSTREAM_API_KEY": KEY})
    assert code == 1 and f"not on the server at {server}" in stderr, stderr  # both variables taken
    code, _, stderr = cli(args + ["--server", server], desk, {"LIPSTREAM_SERVER": dead, "LIPSTREAM_API_KEY": KEY})
    assert code == 1 and f"not on the server at {server}" in stderr, stderr  # the flag over the variable
    code, _, stderr = cli(args + ["--api-key", KEY], desk, {"LIPSTREAM_SERVER": server,
                                                           "LIPSTREAM_API_KEY": "not-the-key-0123456789"})
    assert code == 1 and f"not on the server at {server}" in stderr, stderr  # --api-key over the variable
    code, stdout, stderr = cli(args + ["--server", "", "--avatars", "nowhere", *LOCAL], desk,
                               {"LIPSTREAM_SERVER": server})
    assert code == 1 and "the avatars folder nowhere does not exist" in stderr, stderr  # a local render
    code, _, stderr = cli(args + ["--device", "cpu"], desk, {"LIPSTREAM_SERVER": dead})
    assert code == 2 and "--device: not with --server (here $LIPSTREAM_SERVER)" in stderr, stderr
    assert not out.exists()


def test_a_keysync_render_on_the_server_is_the_local_one(server, desk, presenter, tmp_path):
    """--model keysync goes with the job: the server loads KeySync (random, as its networks) on the first such
    job and renders it beside its live engine; the frames are a local KeySync render's."""
    out = tmp_path / "out"
    out.mkdir()
    code, stdout, stderr = cli(["render", "--server", server, "--avatar", "p", "--audio", desk / "hello.wav",
                                "-o", out / "remote.mp4", "--crf", "0", "--model", "keysync"], desk,
                               {"LIPSTREAM_API_KEY": KEY})
    assert code == 0, stderr
    job = httpx.get(f"{server}/v1/jobs/{_job_id(stderr)}", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert job["options"] == {"crf": 0, "model": "keysync"}
    local = tmp_path / "local.mp4"
    assert main(["render", "--avatar", "p", "--avatars", str(presenter.parent), "--audio", str(desk / "hello.wav"),
                 "-o", str(local), "--crf", "0", "--model", "keysync", *LOCAL]) == 0
    remote, here = _frames(out / "remote.mp4"), _frames(local)
    assert len(remote) == len(here) == 16
    assert _max_difference(remote, here) <= 1


def test_the_jobs_api_refuses_output_options_it_does_not_allow(server, desk):
    """fps, crf, x264_preset and start_frame are checked as the CLI checks them: 422 naming the field,
    no job made."""
    before = len(_jobs(server))
    for field, value in (("fps", "abc"), ("fps", "500"), ("crf", "99"), ("x264_preset", "warp"),
                         ("start_frame", "-1"), ("model", "keysnyc")):
        with open(desk / "hello.wav", "rb") as f:
            r = httpx.post(f"{server}/v1/jobs/render", data={"avatar": "p", field: value},
                           files={"audio": ("hello.wav", f, "audio/wav")}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 422 and r.json()["detail"].startswith(field), (field, r.text)
    assert len(_jobs(server)) == before


def test_a_busy_server_says_when_to_try_again(server, desk, tmp_path):
    """A key at its cap (2 jobs queued or running): the server's 429 and its Retry-After, in one line."""
    headers = {"Authorization": f"Bearer {OTHER_KEY}"}
    held = []
    try:
        for _ in range(2):
            with open(desk / "long.wav", "rb") as f:
                r = httpx.post(f"{server}/v1/jobs/render", data={"avatar": "p"},
                               files={"audio": ("long.wav", f, "audio/wav")}, headers=headers)
            assert r.status_code == 202, r.text
            held.append(r.json()["id"])
        code, stdout, stderr = cli(["render", "--server", server, *RENDER, "-o", tmp_path / "out.mp4"], desk,
                                   {"LIPSTREAM_API_KEY": OTHER_KEY})
        lines = stderr.strip().splitlines()
        assert code == 1 and lines[-1].startswith(f"error: the server at {server} is busy (429)"), stderr
        assert "2 jobs queued or running" in lines[-1] and "try again in 5 s" in lines[-1], lines[-1]
        assert [line for line in lines if line.startswith("error:")] == [lines[-1]]
        assert not (tmp_path / "out.mp4").exists() and not list(tmp_path.iterdir())
    finally:
        for job in held:
            httpx.delete(f"{server}/v1/jobs/{job}", headers=headers)
        _wait_for(server, held, OTHER_KEY, {"cancelled", "done"})


def _wait_for(url: str, ids: list[str], key: str, statuses: set[str], timeout: float = 120.0) -> dict[str, str]:
    t = time.monotonic()
    while True:
        now = {j["id"]: j["status"] for j in _jobs(url, key) if j["id"] in ids}
        if all(now.get(i) in statuses for i in ids):
            return now
        assert time.monotonic() - t < timeout, now
        time.sleep(0.2)


def test_ctrl_c_cancels_the_job_on_the_server_and_leaves_nothing(server, desk, tmp_path):
    """SIGINT while the job renders: exit 130 at once with the local render's line, no output or
    temporary file, and the job cancelled on the server (not left rendering for nobody)."""
    errors = tmp_path / "stderr.txt"
    out = tmp_path / "out"
    out.mkdir()
    with open(errors, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "lipstream", "render", "--server", server, "--avatar", "p",
                                 "--audio", str(desk / "long.wav"), "-o", str(out / "out.mp4")], cwd=desk,
                                env=_env({"LIPSTREAM_API_KEY": KEY}), stdout=subprocess.DEVNULL, stderr=f)
    try:
        t = time.monotonic()
        while "running" not in errors.read_text():
            assert proc.poll() is None, errors.read_text()
            assert time.monotonic() - t < 120, errors.read_text()
            time.sleep(0.05)
        assert os.listdir(out) != []  # the output's temporary file, while the job runs
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    text = errors.read_text()
    assert text.strip().splitlines()[-1] == "interrupted: stopped, no output written", text
    assert os.listdir(out) == []
    job = _job_id(text)
    assert _wait_for(server, [job], KEY, {"cancelled", "done", "failed"}) == {job: "cancelled"}


def test_the_script_sent_is_the_same_program_with_the_uploads_names(tmp_path):
    """Cameras, start frames, crossfades and fps survive the rewrite; each audio is named as uploaded (one
    upload for a file two scenes share); the avatars folder stays here, with a note."""
    from lipstream.client.upload import prepare_upload
    from lipstream.render.script import load_script

    (tmp_path / "a").mkdir()
    write_audio(tmp_path / "a" / "intro speech.wav", speech_like(0.5, 16_000, seed=1), 16_000)
    write_audio(tmp_path / "b.flac", speech_like(0.5, 16_000, seed=2), 16_000)
    script = tmp_path / "show.yaml"
    script.write_text("fps: 30000/1001\navatars: ./avatars\nscenes:\n"
                      "  - {avatar: anchor, audio: 'a/intro speech.wav'}\n"
                      "  - audio: b.flac\n    start_frame: 4\n    transition: {crossfade: 6}\n    cameras:\n"
                      "      - {at: 0, avatar: wide}\n      - {at: 0.25, avatar: anchor}\n"
                      "  - {avatar: wide, audio: 'a/intro speech.wav'}\n")
    program = load_script(script)
    upload = prepare_upload(program, "broadcast", tmp_path / "out.mp4")
    assert list(upload.audio) == ["01-intro_speech.wav", "02-b.flac"] and upload.avatars == ("anchor", "wide")
    assert upload.notes and "not used with --server" in upload.notes[0]
    sent = tmp_path / "sent"
    sent.mkdir()
    (sent / "script.yaml").write_text(upload.script)
    for name, path in upload.audio.items():
        (sent / name).write_bytes(path.read_bytes())
    again = load_script(sent / "script.yaml")
    assert again.fps == program.fps and again.avatars_dir is None
    for a, b in zip(again.scenes, program.scenes, strict=True):
        assert (a.shots, a.start_frame, a.crossfade) == (b.shots, b.start_frame, b.crossfade)
        assert a.audio.read_bytes() == b.audio.read_bytes()
