"""The GPU core behind one interface (interface.py): resident avatars, batches of frame requests -> frames.

The names below load on first use (PEP 562): the CLI's checks read `lipstream.options` without torch.
"""

from __future__ import annotations

import importlib

_LAZY = {"FrameRequest": "interface", "FrameEngine": "interface", "Engine": "runner", "CompiledEngine": "runner",
         "StepEngine": "runner", "ReferenceEngine": "reference", "make_engine": "build"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
