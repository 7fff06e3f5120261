"""Shared fixtures: tiny random MuseTalk networks (CPU, seconds) and a random checkpoint on disk."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test may reach a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_models():
    from lipstream.models import load_musetalk

    return load_musetalk(random_weights=True, size="tiny", device="cpu", seed=0)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random model set written in the upstream layout (legacy .pth/.bin files)."""
    from lipstream.models.export import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("models"), size="tiny", seed=0, binary=True)


@pytest.fixture(scope="session")
def presenter(tmp_path_factory, tiny_models):
    """A compiled avatar of a 640 x 360 action loop (6 frames) whose mask starts low in the face. Its
    landmarks come from the loop's known motion (no face detector): the tests that use it are about
    rendering, and run where dlib's 68-point model is not installed (the H200 image)."""
    from lipstream.fixtures.avatar import tracked_avatar

    return tracked_avatar(tmp_path_factory.mktemp("presenter"), "p", tiny_models.vae, tiny_models.fingerprints["vae"],
                          width=640, height=360, seconds=0.6, fps=10, seed=4)


def _face_model_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("dlib") is not None and importlib.util.find_spec("face_recognition_models") is not None


def pytest_collection_modifyitems(config, items):
    """Tests marked face_model track faces with dlib's 68-point model. They are skipped only where the
    caller says the machine cannot have it (LIPSTREAM_TESTS_NO_FACE_MODEL=1: the H200 image, where the
    100 MB model cannot travel); everywhere else a missing model fails them, as it fails a user."""
    if os.environ.get("LIPSTREAM_TESTS_NO_FACE_MODEL") != "1" or _face_model_installed():
        return
    skip = pytest.mark.skip(reason="dlib's 68-point face model is not installed (LIPSTREAM_TESTS_NO_FACE_MODEL=1)")
    for item in items:
        if "face_model" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With LIPSTREAM_TEST_FAILURES=FILE, each failure's report is appended to FILE as it happens, so a
    run cut by a time limit (the device's calls) still says why its tests failed."""
    path = os.environ.get("LIPSTREAM_TEST_FAILURES")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as out:
            out.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n\n")


class _ReplayGraph:
    """Stands in for a CUDA graph on the CPU: static inputs and output, `fn` run again at each replay."""

    def __init__(self, fn, inputs, device, pool, warmups=2):
        self.fn, self.inputs = fn, inputs
        self.out = fn(**inputs)
        self.graph = type("Pool", (), {"pool": staticmethod(lambda: "pool")})()

    def replay(self):
        out = self.fn(**self.inputs)
        if out is not None:
            self.out.copy_(out)  # the graph's output memory is fixed: readers hold this tensor
        return self.out


@pytest.fixture
def replay_graphs(monkeypatch):
    """The engine's CUDA graphs played by a CPU stand-in (an engine made with graphs=True uses it)."""
    from lipstream.engine import engines

    monkeypatch.setattr(engines, "_Graph", _ReplayGraph)
