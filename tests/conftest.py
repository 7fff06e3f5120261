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
