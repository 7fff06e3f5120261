"""LipStream: MuseTalk v1.5 lip-sync for AI presenters on the GPU; a package per subject (docs/ARCHITECTURE.md).

`lazy_names` is what the packages' __init__ files use to load their names on first use (PEP 562), so a
light import (the CLI's checks, a remote client) does not pull torch in through a package.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from lipstream.errors import LipStreamError

__version__ = "0.1.0"
__all__ = ["LipStreamError", "__version__", "lazy_names"]


def lazy_names(package: str, namespace: dict[str, Any], table: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: name -> the submodule that defines it, imported when asked for."""
    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{table[name]}"), name)
        namespace[name] = value
        return value

    return __getattr__
