"""Package names that load on first use (PEP 562), so a light import (the CLI's checks, a remote
client) does not pull torch in through a package's __init__."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, namespace: dict[str, Any], table: dict[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: name -> the submodule that defines it, imported when asked for."""
    def __getattr__(name: str) -> Any:
        if name not in table:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{table[name]}"), name)
        namespace[name] = value
        return value

    return __getattr__
