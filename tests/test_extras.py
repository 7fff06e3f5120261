"""The core install and its extras: a command whose extra is missing says, in one line and before anything
heavy loads, which `pip install 'lipstream[...]'` brings it; the core commands import no extra.

Each case runs in a fresh interpreter where the extra's packages are hidden (a meta-path finder that
answers "no module" for them), as on a machine where only `pip install lipstream` ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from lipstream.errors import EXTRAS, MissingExtra, require

ROOT = Path(__file__).resolve().parents[1]
HIDE = """
import sys
HIDDEN = set(sys.argv.pop(1).split(","))


class Hidden:
    def find_spec(self, name, path=None, target=None):
        if name in HIDDEN or name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)


sys.meta_path.insert(0, Hidden())
"""
CLI = HIDE + """
from lipstream.cli import main
code = main(sys.argv[1:])
print("torch-imported" if "torch" in sys.modules else "torch-not-imported")
sys.exit(code)
"""
SERVE = ["fastapi", "uvicorn", "aiortc", "httpx"]


def run(code: str, hidden: list[str], args: list, cwd: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "COLUMNS": "200", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-c", code, ",".join(hidden), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env=env)


def assert_one_line(p: subprocess.CompletedProcess, line: str, code: int = 1) -> None:
    """Exit `code`, stderr exactly the one line `line`, and torch never imported."""
    assert p.returncode == code, p.stderr
    assert p.stderr.strip().splitlines() == [line], p.stderr
    assert "torch-not-imported" in p.stdout


def test_serve_without_the_serve_extra_names_it(tmp_path):
    (tmp_path / "avatars").mkdir()
    p = run(CLI, SERVE, ["serve", "--avatars", "avatars", "--random-weights"], tmp_path)
    assert_one_line(p, "error: lipstream serve needs the serve extra: pip install 'lipstream[serve]'")
    assert sorted(os.listdir(tmp_path)) == ["avatars"]  # no data folder, no job store


def test_serve_bench_without_the_serve_extra_names_it(tmp_path):
    p = run(CLI, SERVE, ["serve-bench", "--sessions", "1", "-o", "report"], tmp_path)
    assert_one_line(p, "error: lipstream serve-bench needs the serve extra: pip install 'lipstream[serve]'")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("command", ["render", "broadcast"])
def test_a_render_on_a_server_without_the_serve_extra_names_it(tmp_path, command):
    (tmp_path / "hello.wav").write_bytes(b"RIFF....WAVE")  # never read: the command stops before
    (tmp_path / "show.yaml").write_text("scenes: []\n")
    args = (["render", "--avatar", "anna", "--audio", "hello.wav"] if command == "render" else
            ["broadcast", "show.yaml"]) + ["-o", "out.mp4", "--server", "http://127.0.0.1:9"]
    p = run(CLI, ["httpx"], args, tmp_path)
    assert_one_line(p, f"error: lipstream {command} --server needs the serve extra: pip install 'lipstream[serve]'")
    assert not (tmp_path / "out.mp4").exists()


def test_compile_without_dlib_or_dwpose_says_how_to_get_a_face_tracker(tmp_path):
    """The licence-clean default: no dlib is needed, but without DWPose's weights either, compile stops in one
    line before anything loads, naming the three ways on."""
    (tmp_path / "loop.mp4").write_bytes(b"not read")
    (tmp_path / "models").mkdir()
    p = run(CLI, ["dlib"], ["compile", "loop.mp4", "-o", "avatars", "--models", "models"], tmp_path)
    assert_one_line(p, "error: no face tracker: run `lipstream weights download` for DWPose (Apache-2.0 weights) into "
                       "models, or pass --track FILE with landmarks or boxes, or install the dlib extra (its model is "
                       "for non-commercial use)")
    assert sorted(os.listdir(tmp_path)) == ["loop.mp4", "models"]


def test_the_options_that_need_an_extra_name_it(tmp_path):
    (tmp_path / "avatars").mkdir()
    serve = ["serve", "--avatars", "avatars", "--data", "data", "--random-weights", "--port", "0"]  # 0: any free one
    p = run(CLI, ["ray"], [*serve, "--replicas", "2"], tmp_path)
    assert_one_line(p, "error: --replicas needs the ray extra: pip install 'lipstream[ray]'")
    p = run(CLI, ["psycopg"], [*serve, "--database", "postgresql://u:secret@127.0.0.1:1/db"], tmp_path)
    assert_one_line(p, "error: the PostgreSQL job store needs the postgres extra: pip install 'lipstream[postgres]'")
    p = run(CLI, ["livekit"], ["livekit-worker", "--url", "ws://127.0.0.1:7880", "--api-key", "k", "--api-secret",
                               "s", "--avatar", "anna"], tmp_path)
    assert_one_line(p, "error: lipstream livekit-worker needs the livekit extra: pip install 'lipstream[livekit]'")
    assert sorted(os.listdir(tmp_path)) == ["avatars"]


@pytest.mark.parametrize("statement, hidden, extra", [
    ("from lipstream.client import connect", ["aiortc"], "serve"),
    ("from lipstream.client import JobServer", ["httpx"], "serve"),
    ("import lipstream.integrations.pipecat", ["pipecat"], "pipecat"),
    ("import lipstream.integrations.livekit", ["livekit"], "livekit"),
])
def test_the_library_modules_of_an_extra_raise_an_import_error_naming_it(tmp_path, statement, hidden, extra):
    code = HIDE + f"""
try:
    {statement}
except ImportError as e:
    from lipstream.errors import LipStreamError
    print(type(e).__name__, isinstance(e, LipStreamError), e)
"""
    p = run(code, hidden, [], tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith(f"needs the {extra} extra: pip install 'lipstream[{extra}]'"), p.stdout
    assert p.stdout.startswith("MissingExtra True "), p.stdout


def test_the_core_commands_import_no_extra(tmp_path):
    """The command line and the modules compile, render, broadcast, features, warmup, weights and bench run
    on import none of the extras' packages (nor matplotlib or scikit-image)."""
    extras = sorted({m.split(".")[0] for modules in EXTRAS.values() for m in modules} | {"matplotlib", "skimage"})
    code = """
import json, sys
import lipstream.cli
light = sorted(m for m in sys.modules if m.split(".")[0] in EXTRAS)
import lipstream.audio, lipstream.avatar.compile, lipstream.bench.live, lipstream.bench.run, lipstream.engine.aot_build
import lipstream.engine.networks, lipstream.models.download, lipstream.render.program, lipstream.render.script
print(json.dumps([light, sorted(m for m in sys.modules if m.split(".")[0] in EXTRAS)]))
""".replace("EXTRAS", repr(set(extras)))
    p = run(HIDE + code, ["nothing"], [], tmp_path)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [[], []]


def test_the_extras_named_are_the_packages(tmp_path):
    """Every extra `require` names is one of pyproject.toml's; the core has none of the extras' packages."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(EXTRAS) <= set(project["optional-dependencies"])
    core = " ".join(project["dependencies"]).lower()
    for banned in ("dlib", "face-recognition", "scikit-image", "matplotlib", "fastapi", "uvicorn", "aiortc",
                   "httpx", "psycopg", "prometheus", "websockets", "multipart", "ray"):
        assert banned not in core, banned
    with pytest.raises(MissingExtra, match=r"^x needs the serve extra: pip install 'lipstream\[serve\]'$"):
        require("serve", "x", "lipstream_no_such_module")
    require("serve", "x", "json")  # present: nothing raised
