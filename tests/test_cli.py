"""The `lipstream` command: only working commands are listed, errors are one line, outputs are atomic."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors import safe_open

from lipstream.cli import main
from lipstream.fixtures import speech_like, write_audio


def _noise(n: int) -> bytes:
    """Seeded garbage: a corrupt-file test must not pass or fail by chance."""
    return np.random.default_rng(n).bytes(n)


def lipstream(*args, env=None):
    """Run the installed console script the way a user does."""
    exe = shutil.which("lipstream", path=os.path.dirname(sys.executable)) or shutil.which("lipstream")
    cmd = [exe] if exe else [sys.executable, "-m", "lipstream"]  # no console script: lipstream on PYTHONPATH only
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200", **(env or {})})


def test_help_lists_only_working_commands():
    """The commands --help lists are exactly these, and each one answers its own --help."""
    r = lipstream("--help")
    assert r.returncode == 0
    panel = r.stdout[r.stdout.index("Commands"):]
    listed = re.findall(r"^│ (\S+) {2,}\S", panel, re.M)
    assert sorted(listed) == sorted(["compile", "render", "broadcast", "warmup", "bench", "features", "weights",
                                     "live-bench", "serve", "serve-bench", "livekit-worker"]), listed
    for cmd in listed:
        help_ = lipstream(cmd, "--help")
        assert help_.returncode == 0 and "Usage: lipstream " + cmd in help_.stdout, (cmd, help_.stderr)


def test_serve_refuses_bad_options_in_one_line(tmp_path):
    """Before any network loads: a missing avatars folder, a public address without a key, a short key."""
    (tmp_path / "avatars").mkdir()
    cases = [(["--avatars", tmp_path / "none"], "--avatars"),
             (["--avatars", tmp_path / "avatars", "--host", "0.0.0.0"], "--host 0.0.0.0"),
             (["--avatars", tmp_path / "avatars", "--api-key", "short"], "--api-key"),
             (["--avatars", tmp_path / "avatars", "--live-preset", "fast"], "--live-preset 'fast'"),
             (["--avatars", tmp_path / "avatars", "--playout-delay-ms", "10"], "--playout-delay-ms 10"),
             (["--avatars", tmp_path / "avatars", "--switch-interval-ms", "50"], "--switch-interval-ms 50"),
             (["--avatars", tmp_path / "avatars", "--rtc-workers", "0"], "--rtc-workers 0")]
    for args, named in cases:
        r = lipstream("serve", *args, "--random-weights", env={"LIPSTREAM_API_KEYS": ""})
        assert r.returncode == 2 and named in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_serve_bench_refuses_bad_options_in_one_line(tmp_path):
    """Before any client starts: counts, codec, chunk length, the URL."""
    cases = [(["--sessions", "0"], "--sessions"), (["--codec", "av1"], "--codec 'av1'"),
             (["--chunk-ms", "5"], "--chunk-ms 5"), (["--url", "localhost:8000"], "--url"),
             (["--playout-delay-ms", "250,x"], "--playout-delay-ms '250,x'"),
             (["--playout-delay-ms", "20"], "--playout-delay-ms '20'")]
    for args, named in cases:
        r = lipstream("serve-bench", *args, "-o", tmp_path / "out")
        assert r.returncode == 2 and named in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out").exists()


def test_serve_bench_without_a_server_there_says_so_in_one_line(tmp_path):
    """Nothing listens at --url (a server not started, or not ready yet): the rows and the soak alike end in
    one line naming the URL, not 'unexpected ConnectError ... a bug'."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # free: nothing listens once closed
    for mode in (["--sessions", "1", "--no-warmup"], ["--soak", "1", "--sample-s", "30"]):
        r = lipstream("serve-bench", "--url", url, *mode, "-o", tmp_path / "out")
        line = r.stderr.strip()
        assert r.returncode == 1 and line.startswith(f"error: --url {url}: ") and "\n" not in line, r.stderr
        assert "bug" not in line and "refused" in line.lower(), line


def test_verify_reports_each_component(tiny_checkpoint):
    r = lipstream("weights", "verify", "--models", tiny_checkpoint)
    assert r.returncode == 0, r.stderr
    for name in ("unet", "vae", "whisper", "dwpose"):
        assert name in r.stdout
    assert r.stdout.count(" ok ") == 4 and "fingerprint" in r.stdout and "parameters" in r.stdout
    assert "conv_in.weight [32, 8, 3, 3]" in r.stdout and "backbone.stem.0.conv.weight [4, 3, 3, 3]" in r.stdout
    assert "dwpose/dw-ll_ucoco_384.pth" in r.stdout and "mmengine (restricted unpickler)" in r.stdout


def test_verify_says_dwpose_is_absent_without_failing(tmp_path, tiny_checkpoint):
    """A MuseTalk folder without dwpose/ renders and serves: verify names what compile will lack and passes."""
    root = tmp_path / "m"
    shutil.copytree(tiny_checkpoint, root)
    shutil.rmtree(root / "dwpose")
    r = lipstream("weights", "verify", "--models", root)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(" ok ") == 3 and "dwpose   absent" in r.stdout and "weights download" in r.stdout


@pytest.mark.slow
def test_verify_fails_on_a_corrupt_file(tmp_path, tiny_checkpoint):
    root = tmp_path / "m"
    shutil.copytree(tiny_checkpoint, root)
    # b"\x80\x05" makes torch warn of an unusual pickle protocol; the error must stay one line
    (root / "sd-vae/diffusion_pytorch_model.bin").write_bytes(b"\x80\x05" + _noise(2000))
    r = lipstream("weights", "verify", "--models", root)
    assert r.returncode == 1
    assert "FAILED" in r.stdout and "diffusion_pytorch_model.bin: cannot read weights" in r.stdout
    assert r.stderr.strip().startswith("error:") and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr


def test_download_offline_says_so(tmp_path):
    r = lipstream("weights", "download", "--models", tmp_path / "m", env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 1
    assert "cannot download TMElyralab/MuseTalk" in r.stderr and "offline" in r.stderr
    assert "musetalkV15/unet.pth" in r.stderr  # tells which files to fetch by hand
    assert "Traceback" not in r.stderr


def test_download_skips_present_files(tiny_checkpoint, capsys):
    assert main(["weights", "download", "--models", str(tiny_checkpoint)]) == 0
    assert "0 files downloaded" in capsys.readouterr().out


def test_features_writes_windows(tmp_path):
    audio = write_audio(tmp_path / "speech.wav", speech_like(1.3), 16000)
    out = tmp_path / "f.safetensors"
    r = lipstream("features", audio, "--fps", "30", "--random-weights", "--device", "cpu", "-o", out)
    assert r.returncode == 0, r.stderr
    assert "RANDOM WEIGHTS" in r.stderr
    with safe_open(str(out), "pt") as f:
        assert f.get_tensor("windows").shape == (39, 50, 384)
        assert f.get_tensor("features").shape == (65, 5, 384)
        assert f.metadata()["fps"] == "30" and f.metadata()["samples"] == "20800"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.safetensors", "speech.wav"]


def test_features_without_weights_explains(tmp_path):
    audio = write_audio(tmp_path / "speech.wav", speech_like(0.5), 16000)
    r = lipstream("features", audio, "--models", tmp_path / "none", "--device", "cpu")
    assert r.returncode == 1
    assert "does not exist" in r.stderr and "lipstream weights download" in r.stderr


@pytest.mark.parametrize("make, problem", [
    (lambda p: p, "no such audio file"),
    (lambda p: (p.mkdir(), p)[1], "is a folder"),
    (lambda p: (p.write_bytes(b""), p)[1], "is empty (0 bytes)"),
    (lambda p: (p.write_bytes(_noise(4096)), p)[1], "not a readable audio"),
])
def test_features_bad_audio_is_one_line(tmp_path, make, problem, capsys):
    path = make(tmp_path / "in.wav")
    code = main(["features", str(path), "--random-weights", "--device", "cpu", "-o", str(tmp_path / "o.st")])
    err = capsys.readouterr().err
    assert code == 1
    assert problem in err and str(path) in err and "Traceback" not in err
    assert not (tmp_path / "o.st").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".part")]


def test_cuda_requested_without_a_gpu(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    audio = write_audio(tmp_path / "s.wav", speech_like(0.2), 16000)
    assert main(["features", str(audio), "--random-weights", "--device", "cuda"]) == 1
    assert "no CUDA device" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.face_model
def test_compile_command(tmp_path):
    from lipstream.fixtures.avatar import action_loop, still_image

    inputs = tmp_path / "loops"
    inputs.mkdir()
    action_loop(inputs / "anchor.mp4", width=480, height=270, seconds=0.6)
    still_image(inputs / "photo.jpg", width=480, height=270)
    (inputs / "broken.mov").write_bytes(_noise(3000))
    out = tmp_path / "avatars"
    args = ("compile", inputs, "-o", out, "--random-weights", "--random-size", "tiny", "--device", "cpu")
    r = lipstream(*args)
    assert r.returncode == 1  # one input failed; the others were still compiled
    assert "anchor" in r.stdout and "photo" in r.stdout and r.stdout.count("compiled") == 2
    assert "broken.mov: not a readable video" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["anchor", "photo"]
    (inputs / "broken.mov").unlink()
    again = lipstream(*args)
    assert again.returncode == 0 and again.stdout.count("skipped") == 2
    assert lipstream(*args, "--force").stdout.count("compiled") == 2


@pytest.mark.face_model
def test_random_weights_alone_just_work_on_a_cpu(tmp_path):
    """--random-weights with no size: compile picks tiny on the CPU, render follows the avatar (it used to build
    full-size networks, about 4 s a frame here, and then refuse the tiny avatar's VAE)."""
    import json

    from lipstream.fixtures.avatar import action_loop

    action_loop(tmp_path / "anchor.mp4", width=480, height=270, seconds=0.5, fps=10)
    write_audio(tmp_path / "hello.wav", speech_like(0.6, 16000), 16000)
    r = lipstream("compile", tmp_path / "anchor.mp4", "-o", tmp_path / "avatars", "--random-weights", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "avatars" / "anchor" / "avatar.json").read_text())
    assert meta["vae"]["random"] == "tiny"
    r = lipstream("render", "--avatar", "anchor", "--avatars", tmp_path / "avatars", "--audio", tmp_path / "hello.wav",
                  "-o", tmp_path / "out.mp4", "--random-weights", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert "uncompiled engine: tiny random networks on cpu" in r.stderr and (tmp_path / "out.mp4").is_file()


def test_an_unexpected_exception_in_a_command_is_one_line_and_exit_1(monkeypatch, capsys, tmp_path):
    """A bug inside a command (here: weights verify raising RuntimeError) ends in one error line naming
    the exception and status 1: no traceback, and none from the CLI's own error handling."""
    import lipstream.models.verify

    def broken(*args, **kwargs):
        raise RuntimeError("something inside broke\nsecond line")

    monkeypatch.setattr(lipstream.models.verify, "verify", broken)
    assert main(["weights", "verify", "--models", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "RuntimeError: something inside broke" in err[0] and "LIPSTREAM_LOG" in err[0], err


def test_render_timings_table_names_every_step_and_adds_up(tmp_path, presenter):
    """--timings: one row per step of the one-shot path, from the process's start to the finished MP4."""
    write_audio(tmp_path / "hello.wav", speech_like(0.8, 16000), 16000)
    r = lipstream("render", "--avatar", presenter, "--audio", tmp_path / "hello.wav", "-o", tmp_path / "out.mp4",
                  "--random-weights", "--random-size", "tiny", "--device", "cpu", "--timings")
    assert r.returncode == 0, r.stderr
    rows = dict(re.findall(r"^│ ([^│]+?)\s+│\s+(-?[\d.]+)\s+│", r.stderr, re.M))
    for step in ("imports and checks", "torch and the device", "networks", "render set-up", "avatars: load",
                 "graph capture", "audio decode: wait past the capture",
                 "show layers and music: wait past the capture", "audio: Whisper features and windows",
                 "first encoded packet (after render start)", "frames (render loop)",
                 "flush: last segments, audio, faststart", "render_program total"):
        assert step in rows, (step, r.stderr)
    assert "waits:" in r.stderr  # the render loop's note: who waited for whom (GPU side, encoders)
    busy = re.search(r"([\d.]+) of (\d+) cores busy", r.stderr)  # and how full the cores were meanwhile
    assert busy and 0 < float(busy.group(1)) <= int(busy.group(2)) + 0.5, r.stderr
    process = float(re.search(r"process: ([\d.]+) s so far", r.stdout).group(1))
    before = sum(float(rows[k]) for k in ("imports and checks", "torch and the device", "networks", "render set-up"))
    assert abs(before + float(rows["render_program total"]) - process) < 0.5  # the rows cover the whole process
    inside = sum(float(rows[k]) for k in ("avatars: load", "graph capture", "audio decode: wait past the capture",
                                         "show layers and music: wait past the capture",
                                         "audio: Whisper features and windows", "frames (render loop)",
                                         "flush: last segments, audio, faststart"))
    assert inside <= float(rows["render_program total"]) + 0.05


def test_the_start_runs_without_collections_and_freezes_what_it_made():
    """A one-shot start: no garbage collection while torch imports and the networks load; after it, what it
    made is frozen (later collections skip it). A start that fails leaves the collector as it found it."""
    import gc

    from lipstream.cli.common import start_without_collections

    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with start_without_collections():
        assert not gc.isenabled()
        made = [[k] for k in range(1000)]  # objects the start makes
    try:
        assert gc.isenabled() and gc.get_freeze_count() >= frozen + len(made)
    finally:
        gc.unfreeze()
    with pytest.raises(ValueError), start_without_collections():
        raise ValueError("the networks did not load")
    assert gc.isenabled() and gc.get_freeze_count() == 0
