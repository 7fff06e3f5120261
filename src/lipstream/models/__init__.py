"""The MuseTalk v1.5 networks in plain torch (unet.py, vae.py, whisper.py), loading the upstream
checkpoints as they are, or seeded random.

The names below load on first use (PEP 562), so `lipstream.models.layout` (where the files live)
can be imported by the CLI's early checks without importing torch (seconds).
"""

from __future__ import annotations

from lipstream import lazy_names

_LAZY = {"MODEL_SIZES": "config", "ModelConfig": "config", "model_config": "config", "COMPONENTS": "load",
         "RANDOM_WARNING": "config", "MuseTalk": "load", "default_dtype": "load", "load_musetalk": "load",
         "PositionalEncoding": "positional"}

__all__ = sorted(_LAZY)


__getattr__ = lazy_names(__name__, globals(), _LAZY)
