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
    """A compiled avatar of a 640 x 360 action loop (6 frames) whose mask starts low in the face."""
    from lipstream.avatar import compile_avatar
    from lipstream.avatar.face import DlibBackend
    from lipstream.fixtures.avatar import action_loop

    root = tmp_path_factory.mktemp("presenter")
    action_loop(root / "p.mp4", width=640, height=360, seconds=0.6, fps=10, seed=4)
    compile_avatar(root / "p.mp4", root / "avatars", tiny_models.vae, tiny_models.fingerprints["vae"],
                   backend=DlibBackend(), progress=False)
    return root / "avatars" / "p"


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
    from lipstream.engine import runner

    monkeypatch.setattr(runner, "_Graph", _ReplayGraph)
