"""One compiled variant per network module, shared by every engine on the same networks."""

from __future__ import annotations

import weakref
from collections.abc import Callable

from torch import nn

_variants: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cached_variant(module: nn.Module, key: object, make: Callable[[], nn.Module]) -> nn.Module:
    """`make()`, once per (module, key) while `module` lives.

    Engines built on the same networks then share one variant module, and so its compiled code:
    torch.compile's cache is per module, and every new copy would be traced and compiled again.
    """
    per_module = _variants.setdefault(module, {})
    if key not in per_module:
        per_module[key] = make()
    return per_module[key]
