"""Avatars: action loops compiled once into everything the renderer needs that does not depend on audio.

The names load on first use (PEP 562): folders.py (an avatar found by name) imports without torch.
"""

from __future__ import annotations

from lipstream import lazy_names

_LAZY = {"Avatar": "cache", "cycle_length": "cache", "load_avatar": "cache", "ping_pong": "cache",
         "CompileOptions": "compile", "CompileResult": "compile", "compile_avatar": "compile", "compile_many": "compile"}

__all__ = sorted(_LAZY)


__getattr__ = lazy_names(__name__, globals(), _LAZY)
