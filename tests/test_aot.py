"""Ahead-of-time compiled packages (engine/aot.py): the same frames as the modules, and a cache that
never crashes: keys that change with what the code depends on, broken entries removed and rebuilt.

The packages are built once for the tiny networks on the CPU (AOTInductor's C++ path; about two
minutes on 2 cores) into a session cache folder that every test here copies from.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import shutil
import subprocess
import sys
import time

import av
import numpy as np
import pytest
import torch

from lipstream.audio.features import whisper_features
from lipstream.avatar import load_avatar
from lipstream.engine import PackageEngine, ModuleEngine, FrameRequest, make_engine
from lipstream.engine import aot, aot_build
from lipstream.fixtures import speech_like, write_audio
from lipstream.models import model_config
from lipstream.engine.options import EngineOptions
from serve_process import serve_process

pytestmark = pytest.mark.slow  # the AOT packages built once, by a `lipstream serve --compile`: `make test` only

CPU = torch.device("cpu")
SOURCE = aot.random_source("tiny", 0, CPU)  # what conftest's tiny_models are


@dataclasses.dataclass
class Built:
    root: object  # the cache folder
    log: str  # the server's log
    job_frames: int  # frames of the render job it served after moving onto the packages


@pytest.fixture(scope="session")
def background(tmp_path_factory, presenter):
    """The packages as a first `lipstream serve --compile` builds them: it starts on the uncompiled steps with
    nothing cached, runs `lipstream warmup` beside itself (two packages at once, forced: on 2 cores the default
    is one after the other), moves onto them and serves a job. Every test here then copies that cache."""
    root = tmp_path_factory.mktemp("aot-cache")
    work = tmp_path_factory.mktemp("first-serve")
    env = {**os.environ, "LIPSTREAM_CACHE": str(root), "LIPSTREAM_WARMUP_JOBS": "2", "LIPSTREAM_API_KEYS": "",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "LIPSTREAM_SERVER": ""}
    log = work / "serve.log"
    with serve_process(["--avatars", presenter.parent, "--data", work / "data", "--random-weights",
                        "--random-size", "tiny", "--device", "cpu", "--compile"], env, log) as url:
        t = time.monotonic()
        while '"engine_upgraded"' not in log.read_text():
            assert '"compile_failed"' not in log.read_text(), log.read_text()[-3000:]
            assert time.monotonic() - t < 900, "no upgrade: " + log.read_text()[-2000:]
            time.sleep(1)
        write_audio(work / "hello.wav", speech_like(1.0, 16000), 16000)
        r = subprocess.run([sys.executable, "-m", "lipstream", "render", "--server", url, "--avatar", presenter.name,
                            "--audio", str(work / "hello.wav"), "-o", str(work / "out.mp4")],
                           env=env, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr
        with av.open(str(work / "out.mp4")) as c:
            frames = sum(1 for _ in c.decode(video=0))
    return Built(root, log.read_text() + (work / "data" / "warmup.log").read_text(), frames)


@pytest.fixture(scope="session")
def built_cache(background):
    return background.root


def test_a_first_serve_starts_uncompiled_and_moves_onto_the_packages_it_builds(background):
    ready = next(json.loads(line) for line in background.log.splitlines() if '"event": "ready"' in line)
    assert ready["engine"] == "modules, compiled packages building in the background"
    assert "capture_and_compile_s" in ready["phases"]
    upgraded = next(json.loads(line) for line in background.log.splitlines() if '"engine_upgraded"' in line)
    assert upgraded["engine"] == "compiled packages" and upgraded["capacity_fps"] > 0
    assert "4 built, 0 already cached, 0 failed" in background.log  # warmup's own line
    assert background.job_frames == 10  # the job after the move: 1 s at the loop's 10 fps


def test_warmup_built_two_packages_at_once(built_cache):
    """Each package in a process of its own, two at a time: the first two ran together."""
    spans = {}
    for meta_file in (built_cache / "aot" / "packages").glob("*/" + aot.META_FILE):
        meta = json.loads(meta_file.read_text())
        end = datetime.datetime.fromisoformat(meta["built"]).timestamp()
        spans[meta["kind"]] = (end - meta["build_s"] - 1, end + 1)  # the stamp is to the second
    assert set(spans) == {"whisper", "crop", "full"}
    (a0, a1), (b0, b1) = spans["whisper"], spans["crop"]
    assert a0 < b1 and b0 < a1, spans


@pytest.fixture
def cache(built_cache, tmp_path):
    """A private copy of the built cache (a test may break it)."""
    root = tmp_path / "cache"
    shutil.copytree(built_cache, root)
    return root


def _frames(engine: ModuleEngine, avatar_dir, windows: torch.Tensor) -> torch.Tensor:
    slot = engine.add_avatar(load_avatar(avatar_dir))
    n = engine.avatars[slot].num_frames
    return engine.render([FrameRequest(slot, i % n, windows[i]) for i in range(len(windows))]).clone()


@pytest.mark.parametrize("rows", ["auto", "full"])
def test_compiled_frames_match_the_modules(built_cache, tiny_models, presenter, rows):
    compiled = aot.load_compiled(model_config("tiny"), SOURCE, CPU, root=built_cache)
    windows = torch.randn(7, 50, 384, generator=torch.Generator().manual_seed(5))
    engine = make_engine(compiled, EngineOptions(batch=4, decode_rows=rows))
    assert isinstance(engine, PackageEngine)  # the compiled packages' own engine, chosen by type
    fast = _frames(engine, presenter, windows)
    plain = _frames(ModuleEngine(tiny_models, EngineOptions(batch=4, decode_rows=rows)), presenter, windows)
    assert fast.shape == plain.shape and fast.dtype == torch.uint8
    assert (fast.int() - plain.int()).abs().max() <= 1  # the same maths, fused differently
    assert compiled.fingerprints == tiny_models.fingerprints  # the avatar's VAE check still holds


def test_compiled_whisper_matches_the_encoder(built_cache, tiny_models):
    compiled = aot.load_compiled(model_config("tiny"), SOURCE, CPU, root=built_cache)
    audio = torch.from_numpy(speech_like(31.0, 16000))  # two segments
    fast = whisper_features(audio, compiled)
    plain = whisper_features(audio, tiny_models)
    assert fast.shape == plain.shape == (31 * 50, 5, 384)
    torch.testing.assert_close(fast, plain, atol=2e-4, rtol=1e-4)


def test_loading_the_packages_imports_no_inductor_and_runs_no_isa_probe(built_cache):
    """torch's load_package first compares the package's CPU ISA with this machine's by compiling and running
    probe programs (about 19 s a package on the H200); the render's loader goes to the C++ loader directly."""
    code = ("import json, pathlib, sys, torch; from lipstream.engine import aot; from lipstream.models import model_config;"
            "cpu = torch.device('cpu');"
            f"n = aot.load_compiled(model_config('tiny'), aot.random_source('tiny', 0, cpu), cpu, root=pathlib.Path({str(built_cache)!r}));"
            "print(json.dumps({'kinds': sorted(['whisper'] + [str(k) for k in n.steps]),"
            " 'inductor': sorted(m for m in sys.modules if m.startswith(('torch._inductor', 'torch._dynamo')))}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen == {"kinds": ["False", "True", "whisper"], "inductor": []}


def test_keys_follow_what_the_code_depends_on():
    info = aot.device_info(CPU)
    options = aot.StepOptions(dtype="float32")
    key = aot.package_key("crop", model_config("tiny"), options, info)
    assert key == aot.package_key("crop", model_config("tiny"), options, dict(info))  # stable
    assert key.startswith("crop-")
    changed = [aot.package_key("full", model_config("tiny"), options, info),
               aot.package_key("crop", model_config("full"), options, info),
               aot.package_key("crop", model_config("tiny"), aot.StepOptions(dtype="float32", decode_row=6), info),
               aot.package_key("crop", model_config("tiny"), aot.StepOptions(dtype="float16"), info),
               aot.package_key("crop", model_config("tiny"), options, {**info, "torch": "2.99.0"})]
    assert len({key, *changed}) == 1 + len(changed)
    # The Whisper package does not depend on the UNet or on the decode options.
    assert aot.package_key("whisper", model_config("tiny"), options, info) == \
        aot.package_key("whisper", model_config("tiny"), aot.StepOptions(dtype="float32", decode_row=6), info)
    with pytest.raises(ValueError, match="kind"):
        aot.package_key("unet", model_config("tiny"), options, info)


def test_weights_key_follows_the_files(tmp_path):
    f = tmp_path / "unet.pth"
    f.write_bytes(b"x" * 10)
    options = aot.StepOptions()
    first = aot.weights_key(aot.folder_source([f]), options)
    assert first == aot.weights_key(aot.folder_source([f]), options)
    f.write_bytes(b"y" * 11)
    assert aot.weights_key(aot.folder_source([f]), options) != first
    assert aot.weights_key(aot.random_source("tiny", 0, CPU), options) != \
        aot.weights_key(aot.random_source("tiny", 1, CPU), options)


def test_another_torch_is_not_built(cache, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    with pytest.raises(aot.NotBuilt, match="no compiled crop, full, whisper"):
        aot.load_compiled(model_config("tiny"), SOURCE, CPU, root=cache)


def test_the_weights_file_does_not_depend_on_the_upsample_folds_other_engines_made(tiny_models):
    """An engine of another upsample mode in the process folds its weights onto the shared modules; the
    package weights must not take them in (the cached file would read as stale, and be rebuilt)."""
    from lipstream.models.blocks import fuse_upsamplers
    from lipstream.engine.options import UPSAMPLE_MODES

    options = aot.default_options(CPU)

    def names() -> set[str]:
        return set(aot_build._canonical(aot_build._steps_for_export(tiny_models, options), options.upsample))

    before = names()
    for mode in UPSAMPLE_MODES:
        fuse_upsamplers(tiny_models.vae.decoder, mode)
    assert names() == before
    assert any(n.endswith(f"folded_{options.upsample}") for n in before) == (options.upsample != "plain")


def test_a_corrupt_package_is_removed_with_a_warning_and_rebuilt(cache, tiny_models, caplog):
    folder = next((cache / "aot" / "packages").glob("whisper-*"))
    (folder / aot.PACKAGE_FILE).write_bytes(b"not a package")
    with caplog.at_level(logging.WARNING, logger="lipstream.engine.aot"), pytest.raises(aot.NotBuilt):
        aot.load_compiled(model_config("tiny"), SOURCE, CPU, root=cache)
    assert "does not load" in caplog.text and "lipstream warmup" in caplog.text
    assert not folder.exists()
    statuses = {b.kind: b.status for b in aot_build.build_all(tiny_models, SOURCE, root=cache)}
    assert statuses == {"crop": "cached", "full": "cached", "whisper": "built", "weights": "cached"}
    aot.load_compiled(model_config("tiny"), SOURCE, CPU, root=cache)


def test_a_loader_that_crashes_marks_the_machine_and_renders_stop_trying(cache, tiny_models, monkeypatch):
    """On the H200 image (torch 2.11) loading any package kills the process: found once, by the child check."""
    shutil.rmtree(next((cache / "aot" / "packages").glob("whisper-*")))
    monkeypatch.setattr(aot_build, "_check_in_child", lambda *a: {"ok": False, "signal": 11, "message": "Segmentation fault"})
    results = {b.kind: b for b in aot_build.build_all(tiny_models, SOURCE, root=cache)}
    assert results["whisper"].status == "failed" and "signal 11" in results["whisper"].message
    for kind in ("crop", "full"):  # not tried: they would crash the same way
        assert results[kind].status == "failed" and results[kind].message.startswith("skipped")
    assert not list((cache / "aot" / "packages").glob("whisper-*"))  # nothing half-built is left
    assert not list((cache / "aot" / "packages").glob(".*"))
    assert not list((cache / "aot" / "weights").glob("*"))  # useless here: removed
    again = {b.kind: b.status for b in aot_build.build_all(tiny_models, SOURCE, root=cache)}
    assert set(again.values()) == {"failed"}  # marked: nothing is tried or written again
    assert not list((cache / "aot" / "weights").glob("*"))
    with pytest.raises(aot.NotBuilt, match="does not work on this machine.*signal 11") as info:
        aot.load_compiled(model_config("tiny"), SOURCE, CPU, root=cache)
    assert not info.value.buildable  # the render's note does not suggest a warmup that cannot help
    monkeypatch.undo()
    statuses = {b.kind: b.status for b in aot_build.build_all(tiny_models, SOURCE, root=cache, force=True,
                                                         kinds=("whisper",))}
    assert statuses == {"whisper": "built", "weights": "built"}  # --force clears the mark and tries again
    assert aot.unsupported(aot.device_info(CPU), cache) is None


def test_corrupt_weights_are_removed_with_a_warning(cache, caplog):
    path = next((cache / "aot" / "weights").glob("*.safetensors"))
    path.write_bytes(path.read_bytes()[:1000])
    with caplog.at_level(logging.WARNING, logger="lipstream.engine.aot"), pytest.raises(aot.NotBuilt):
        aot.load_compiled(model_config("tiny"), SOURCE, CPU, root=cache)
    assert "weights" in caplog.text and not path.exists()


def test_the_cache_is_bounded_least_recently_used_first(cache):
    base = cache / "aot"
    entries = sorted((base / "packages").glob("*"))
    for age, entry in enumerate(entries):  # the first is the oldest
        stamp = 1_000_000 + age
        os.utime(entry, (stamp, stamp))
    sizes = {e: sum(f.stat().st_size for f in e.rglob("*") if f.is_file()) for e in entries}
    weights = sum(f.stat().st_size for f in (base / "weights").glob("*"))
    limit = (sum(sizes.values()) + weights - sizes[entries[0]] + 1) / 2**30
    removed = aot.prune(base, limit)
    assert removed == [entries[0]]
    assert all(e.exists() for e in entries[1:])


def test_warmup_and_a_compiled_render_from_the_command_line(built_cache, tmp_path, presenter):
    """`lipstream warmup` finds everything cached; `render --compile` says it runs the compiled engine."""
    # this checkout's package on the path: the GPU image runs the suite from it, with nothing installed
    env = {"LIPSTREAM_CACHE": str(built_cache), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    run = lambda *args: subprocess.run([sys.executable, "-m", "lipstream", *args], capture_output=True,  # noqa: E731
                                       text=True, env=env, cwd=tmp_path, timeout=600)
    p = run("warmup", "--random-weights", "--device", "cpu")
    assert p.returncode == 0, p.stderr
    assert "0 built, 4 already cached, 0 failed" in p.stdout
    write_audio(tmp_path / "s.wav", speech_like(1.0, 16000), 16000)
    p = run("render", "--avatar", str(presenter), "--audio", "s.wav", "-o", "out.mp4", "--random-weights",
            "--device", "cpu", "--compile", "--timings")
    assert p.returncode == 0, p.stderr
    assert "compiled engine: tiny random networks on cpu" in p.stderr
    assert "start-up and render" in p.stderr
    with av.open(str(tmp_path / "out.mp4")) as c:
        assert sum(1 for _ in c.decode(video=0)) == 10  # 1 s at the avatar's 10 fps
    assert [f.name for f in tmp_path.iterdir()] and not list(tmp_path.glob("*.tmp*"))


def test_a_live_engine_on_the_packages_renders_the_modules_frames(built_cache, tiny_models, presenter):
    """What `lipstream serve` runs where warmup built the packages: the live engine's steps from them,
    its Whisper (streaming features) from the module."""
    from lipstream.live import LiveEngine, preset
    from lipstream.models import load_musetalk

    compiled = aot.load_compiled(model_config("tiny"), SOURCE, CPU, kinds=("crop", "full"), root=built_cache)
    light = load_musetalk(random_weights=True, size="tiny", device="cpu", components=("whisper", "vae"), warn=False)
    assert light.unet is None
    windows = torch.randn(6, 50, 384, generator=torch.Generator().manual_seed(9))
    out = {}
    for name, live in (("modules", LiveEngine(tiny_models, preset("cpu"))),
                       ("packages", LiveEngine(light, preset("cpu"), compiled=compiled))):
        avatar = live.add_avatar(load_avatar(presenter))
        with live:
            out[name] = live.render_offline(avatar, list(range(6)), windows).result(timeout=120)
    assert isinstance(live.engine, PackageEngine)
    assert np.abs(out["packages"].astype(int) - out["modules"].astype(int)).max() <= 2
    # a running engine on the modules moves onto the packages (what a first `serve` does once they are built)
    live = LiveEngine(tiny_models, preset("cpu"))
    avatar = live.add_avatar(load_avatar(presenter))
    with live:
        before = live.render_offline(avatar, list(range(6)), windows).result(timeout=120)
        steps = live.use_compiled(compiled)
        after = live.render_offline(avatar, list(range(6)), windows).result(timeout=120)
        assert isinstance(live.engine, PackageEngine) and live.core.runner.engine is live.engine
        assert set(steps) == set(live.engine.buckets) and set(live.step_s) == set(steps)
    assert np.array_equal(before, out["modules"]) and np.array_equal(after, out["packages"])
    with pytest.raises(ValueError, match="inductor"):
        LiveEngine(light, preset("cpu"), compiled=compiled, inductor="all")


def test_serve_starts_on_the_packages_and_renders_a_job(cache, presenter, tmp_path):
    """`lipstream serve --compile` with the packages built: no Inductor at start, the ready event says so,
    and a render job handed to it (`render --server`) comes back whole."""
    env = {**os.environ, "LIPSTREAM_CACHE": str(cache), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
           "LIPSTREAM_API_KEYS": "", "LIPSTREAM_SERVER": ""}
    log = tmp_path / "serve.log"
    with serve_process(["--avatars", presenter.parent, "--data", tmp_path / "data", "--random-weights",
                        "--random-size", "tiny", "--device", "cpu", "--compile"], env, log) as url:
        assert '"engine": "compiled packages"' in log.read_text()
        write_audio(tmp_path / "hello.wav", speech_like(1.0, 16000), 16000)
        r = subprocess.run([sys.executable, "-m", "lipstream", "render", "--server", url, "--avatar", presenter.name,
                            "--audio", str(tmp_path / "hello.wav"), "-o", str(tmp_path / "out.mp4")],
                           env=env, capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr
        with av.open(str(tmp_path / "out.mp4")) as c:
            assert sum(1 for _ in c.decode(video=0)) == 10  # 1 s at the loop's 10 fps
