"""Engine-side variants of the networks' modules, made without touching the networks themselves."""

from __future__ import annotations

import copy
import itertools
import weakref
from collections.abc import Callable

from torch import nn


def shared_copy(module: nn.Module) -> nn.Module:
    """A new module tree that shares every parameter and buffer with `module` (no weights copied).

    Swapping modules in the copy leaves the original alone: the reference path and other engines
    keep using it.
    """
    shared = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())}
    return copy.deepcopy(module, memo=shared)


def replace_modules(module: nn.Module, make: Callable[[nn.Module], nn.Module | None]) -> None:
    """Replace, in place, every descendant for which `make` returns a module."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            new = make(child)
            if new is not None:
                setattr(parent, name, new)


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
