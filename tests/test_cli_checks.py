"""What a user types wrong is caught before anything heavy loads, in one line that says what is allowed.

Each case runs the real CLI in a fresh interpreter and checks that it stopped before torch was
even imported (the networks take 6-20 s to build, torch and diffusers seconds to import).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lipstream.cli import random_size_for

PROBE = ("import sys; from lipstream.cli import main; code = main(sys.argv[1:]); "
         "print('torch-imported' if 'torch' in sys.modules else 'torch-not-imported'); sys.exit(code)")


def run_cli(args: list[str], cwd: Path) -> tuple[int, str, str]:
    p = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                       timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(cwd), "COLUMNS": "200",
                                         **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}})
    return p.returncode, p.stdout, p.stderr


def assert_early_one_line_error(code: int, stdout: str, stderr: str, expected: int, fragments: list[str]) -> None:
    """Exit status `expected`, one line on stderr holding every fragment, and torch never imported."""
    assert code == expected, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "torch-not-imported" in stdout


@pytest.fixture(scope="module")
def desk(tmp_path_factory):
    """A working folder with speech, an avatars folder with two (fake, metadata-only) avatars, a stray folder."""
    root = tmp_path_factory.mktemp("desk")
    (root / "speech.wav").write_bytes(b"RIFF....WAVE")  # never read: every case stops before decoding
    for name, size in (("anna", (640, 360)), ("ben", (640, 360)), ("wide", (1280, 720))):
        folder = root / "avatars" / name
        folder.mkdir(parents=True)
        (folder / "avatar.json").write_text(json.dumps({"width": size[0], "height": size[1], "fps": "25"}))
    (root / "avatars" / "notes").mkdir()
    (root / "photos").mkdir()
    return root


RENDER = ["render", "--avatar", "anna", "--audio", "speech.wav", "-o", "out.mp4", "--avatars", "avatars",
          "--random-weights"]


@pytest.mark.parametrize("extra, fragments", [
    (["--x264-preset", "superfast2"], ["--x264-preset 'superfast2'", "ultrafast", "veryslow"]),
    (["--fps", "abc"], ["--fps 'abc'", "29.97"]),
    (["--fps", "-5"], ["--fps '-5'", "above 0"]),
    (["--fps", "0"], ["--fps '0'", "above 0"]),
    (["--batch", "0"], ["--batch 0", "1 to 256"]),
    (["--batch", "abc"], ["--batch", "int"]),  # click's own wording differs between typer releases
    (["--crf", "99"], ["--crf 99", "0 to 51"]),
    (["--encoders", "0"], ["--encoders 0", "1 to 64"]),
    (["--decode-rows", "half"], ["--decode-rows 'half'", "auto, full, mask"]),
    (["--device", "gpu"], ["--device 'gpu'", "cuda"]),
    (["--random-size", "huge"], ["--random-size 'huge'", "tiny"]),
    (["--start-frame", "-1"], ["--start-frame -1"]),
    (["--no-such-flag"], ["--no-such-flag"]),
], ids=lambda v: v[0] if isinstance(v, list) and v and v[0].startswith("--") else None)
def test_bad_options_are_usage_errors_of_one_line(desk, extra, fragments):
    assert_early_one_line_error(*run_cli(RENDER + extra, desk), 2, fragments)
    assert not (desk / "out.mp4").exists()


@pytest.mark.parametrize("change, fragments", [
    ({"--avatar": "nobody"}, ["nobody", "unknown avatar", "anna, ben, wide"]),
    ({"--avatar": "photos"}, ["photos", "not a compiled avatar", "lipstream compile"]),
    ({"--avatar": "notes"}, ["notes", "not a compiled avatar"]),
    ({"--avatars": "nowhere"}, ["unknown avatar", "nowhere does not exist"]),
    ({"--audio": "missing.wav"}, ["missing.wav", "no such audio file"]),
    ({"--audio": "photos"}, ["photos", "is a folder"]),
    ({"-o": "no/such/dir/out.mp4"}, ["output folder no/such/dir does not exist"]),
    ({"-o": "photos"}, ["photos", "is a folder"]),
], ids=lambda c: "-".join(f"{k.strip('-')}={v}" for k, v in c.items()) if isinstance(c, dict) else None)
def test_bad_paths_are_reported_before_anything_loads(desk, change, fragments):
    args = list(RENDER)
    for flag, value in change.items():
        args[args.index(flag) + 1] = value
    assert_early_one_line_error(*run_cli(args, desk), 1, fragments)


def test_a_broadcast_of_two_frame_sizes_is_refused_early(desk):
    script = desk / "show.yaml"
    script.write_text("scenes:\n  - {avatar: anna, audio: speech.wav}\n  - {avatar: wide, audio: speech.wav}\n")
    code, stdout, stderr = run_cli(["broadcast", script, "-o", "show.mp4", "--avatars", "avatars",
                                    "--random-weights"], desk)
    assert code == 1 and "same frame size" in stderr and "wide 1280x720" in stderr, stderr
    assert "torch-not-imported" in stdout


def test_missing_models_folder_mentions_random_weights(desk):
    args = [a for a in RENDER if a != "--random-weights"] + ["--models", "no-models-here"]
    code, stdout, stderr = run_cli(args, desk)
    assert code == 1 and "no-models-here does not exist" in stderr and "--random-weights" in stderr, stderr
    assert "torch-not-imported" in stdout


def test_compile_checks_its_inputs_first(desk):
    code, stdout, stderr = run_cli(["compile", "nothing.mp4", "-o", "out", "--random-weights"], desk)
    assert code == 1 and "nothing.mp4: no such video" in stderr, stderr
    code, stdout, stderr = run_cli(["compile", "photos", "-o", "out", "--fps", "fast", "--random-weights"], desk)
    assert code == 2 and "--fps 'fast'" in stderr, stderr
    assert "torch-not-imported" in stdout and not (desk / "out").exists()


def test_no_arguments_shows_help(desk):
    code, stdout, stderr = run_cli([], desk)
    assert code == 2 and "render" in stdout + stderr and "compile" in stdout + stderr


def test_random_size_follows_the_avatar_then_the_device():
    assert random_size_for("auto", "cpu", {"vae": {"random": "full"}}) == "full"
    assert random_size_for("auto", "cuda", {"vae": {"random": "tiny"}}) == "tiny"
    assert random_size_for("auto", "cpu", {"vae": {"fingerprint": "abc"}}) == "tiny"
    assert random_size_for("auto", "cuda", None) == "full"
    assert random_size_for("full", "cpu", {"vae": {"random": "tiny"}}) == "full"


def test_old_spellings_still_work_and_say_they_are_deprecated(desk):
    """Renamed options keep their old spelling for one release: a warning line names the new one, and the
    value goes where the new spelling's would (here into the early checks, whose error names the new flag)."""
    code, stdout, stderr = run_cli(RENDER + ["--preset", "superfast2"], desk)
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 2, stderr
    assert "--preset is deprecated" in lines[0] and "--x264-preset" in lines[0]
    assert lines[1].startswith("error:") and "--x264-preset 'superfast2'" in lines[1]
    code, _, stderr = run_cli(RENDER + ["--preset", "veryfast", "--x264-preset", "fast"], desk)
    assert code == 2 and "give --x264-preset only" in stderr, stderr
    # serve: --preset was the live preset, --compile took off|vae|all|auto
    code, stdout, stderr = run_cli(["serve", "--avatars", "nowhere", "--preset", "accurate", "--compile", "off",
                                    "--random-weights"], desk)
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 3, stderr
    assert "--compile off is deprecated" in lines[0] and "--no-compile" in lines[0]
    assert "--preset is deprecated" in lines[1] and "--live-preset" in lines[1]
    assert lines[2].startswith("error:") and "--avatars" in lines[2]
    assert "torch-not-imported" in stdout
    code, _, stderr = run_cli(["serve", "--avatars", "nowhere", "--compile=sometimes", "--random-weights"], desk)
    assert code == 2 and "--compile 'sometimes'" in stderr, stderr


def test_serve_database_errors_are_one_line_before_anything_loads(desk, tmp_path):
    """--database: an unknown scheme, or a PostgreSQL that cannot be reached (no password shown); without
    psycopg installed, the PostgreSQL address says which extra to install instead (tests/test_extras.py)."""
    import importlib.util

    avatars = tmp_path / "avatars"
    avatars.mkdir()
    postgres = ((2, "error: --database", "cannot connect to PostgreSQL") if importlib.util.find_spec("psycopg") else
                (1, "error: the PostgreSQL job store", "pip install 'lipstream[postgres]'"))
    for database, (expected, start, why) in (("mysql://u:secret@h/db", (2, "error: --database", "not a job store "
                                                                                                 "address")),
                                             ("postgresql://u:secret@127.0.0.1:1/db", postgres)):
        code, stdout, stderr = run_cli(["serve", "--avatars", str(avatars), "--data", str(tmp_path / "data"),
                                        "--database", database, "--random-weights", "--port", "0"], desk)
        lines = stderr.strip().splitlines()
        assert code == expected and len(lines) == 1, stderr
        assert lines[0].startswith(start) and why in lines[0] and "secret" not in lines[0]
        assert "torch-not-imported" in stdout


@pytest.mark.parametrize("extra, fragments", [
    (["--replicas", "0"], ["--replicas '0'", "1 to 1024, or auto"]),
    (["--replicas", "x"], ["--replicas 'x'", "1 to 1024, or auto"]),
    (["--ray-address", "auto"], ["--ray-address", "only with --replicas"]),
    (["--replicas", "auto", "--min-replicas", "3", "--max-replicas", "2"],
     ["--min-replicas 3 / --max-replicas 2", "min <= max"]),
    (["--replicas", "1", "--ingress", "nginx"], ["--ingress 'nginx'", "ray or haproxy"]),
    (["--ingress", "haproxy"], ["--ingress haproxy", "only with --replicas"]),
    (["--replicas", "1", "--ray-address", "auto", "--ingress", "haproxy"],
     ["--ingress haproxy", "RAY_SERVE_ENABLE_HA_PROXY=1"]),
], ids=["replicas-0", "replicas-x", "ray-address-alone", "min-over-max", "ingress-unknown", "ingress-alone",
        "ingress-cluster"])
def test_serve_fleet_options_are_one_line_errors_before_anything_loads(desk, tmp_path, extra, fragments):
    """--replicas, --ray-address, --min/--max-replicas, --ingress: checked before Ray or the networks load."""
    avatars = tmp_path / "avatars"
    avatars.mkdir()
    code, stdout, stderr = run_cli(["serve", "--avatars", str(avatars), "--data", str(tmp_path / "data"),
                                    "--random-weights", *extra], desk)
    assert_early_one_line_error(code, stdout, stderr, 2, fragments)
    assert not (tmp_path / "data").exists()


def test_fleet_size_reads_a_fixed_count():
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'lipstream[ray]')")
    from lipstream.cli.serve import fleet_size

    assert fleet_size("2", None, 1, None) == (2, 1, None)
    assert fleet_size(None, None, 1, None) is None


def test_serve_on_a_taken_port_is_a_one_line_error_before_anything_loads(desk, tmp_path):
    """uvicorn (or Ray's proxy) would find it only at its bind, after the networks (or Ray) had started."""
    import importlib.util
    import socket

    avatars = tmp_path / "avatars"
    avatars.mkdir()
    fleet = [["--replicas", "1"]] if importlib.util.find_spec("ray") and importlib.util.find_spec("ray.serve") else []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        for extra in [[], *fleet]:
            code, stdout, stderr = run_cli(["serve", "--avatars", str(avatars), "--data", str(tmp_path / "data"),
                                            "--random-weights", "--port", str(port), *extra], desk)
            assert_early_one_line_error(code, stdout, stderr, 2, [f"--port {port}", "already in use"])
    code, stdout, stderr = run_cli(["serve", "--avatars", str(avatars), "--host", "192.0.2.77", "--api-key",
                                    "k" * 16, "--random-weights"], desk)
    assert_early_one_line_error(code, stdout, stderr, 2, ["--host 192.0.2.77", "not an address of this machine"])
    assert not (tmp_path / "data").exists()


def test_a_haproxy_binary_that_is_not_one_is_named(desk, tmp_path):
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'lipstream[ray]')")
    avatars = tmp_path / "avatars"
    avatars.mkdir()
    p = subprocess.run([sys.executable, "-c", PROBE, "serve", "--avatars", str(avatars), "--random-weights",
                        "--replicas", "1", "--ingress", "haproxy", "--port", "0"], cwd=desk, capture_output=True,
                       text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(desk), "COLUMNS": "200",
                                                    "RAY_SERVE_HAPROXY_BINARY_PATH": str(tmp_path / "haproxy"),
                                                    **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"}})
    assert_early_one_line_error(p.returncode, p.stdout, p.stderr, 2,
                                [f"RAY_SERVE_HAPROXY_BINARY_PATH={tmp_path / 'haproxy'}", "not an executable file"])
