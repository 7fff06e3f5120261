"""The GPU core behind one interface (interface.py): resident avatars, batches of frame requests -> frames.

The names below load on first use (PEP 562): the CLI's checks read `lipstream.engine.options` without torch.
"""

from __future__ import annotations

from lipstream import lazy_names

_LAZY = {"FrameRequest": "interface", "FrameEngine": "interface", "ModuleEngine": "engines", "PackageEngine": "engines",
         "StepEngine": "engines", "ReferenceEngine": "reference", "make_engine": "build",
         "EngineOptions": "options", "ENGINE_PRESETS": "options"}

__all__ = sorted(_LAZY)


__getattr__ = lazy_names(__name__, globals(), _LAZY)
