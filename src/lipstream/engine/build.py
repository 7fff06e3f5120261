"""Which engine a render gets: the reference path, the compiled packages' or the modules' fast engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from lipstream.engine.aot import CompiledNetworks
from lipstream.engine.interface import FrameEngine
from lipstream.engine.reference import ReferenceEngine
from lipstream.engine.engines import PackageEngine, ModuleEngine
from lipstream.engine.options import EngineOptions

if TYPE_CHECKING:
    from lipstream.models import MuseTalk


def make_engine(networks: MuseTalk | CompiledNetworks, options: EngineOptions) -> FrameEngine:
    """The engine for these networks and options (compiled packages: their own fast engine)."""
    if isinstance(networks, CompiledNetworks):
        if options.reference:
            raise ValueError("the reference path runs on the networks' modules, not on compiled packages")
        return PackageEngine(networks, options)
    if options.reference:
        return ReferenceEngine(networks, options.batch or 16)
    return ModuleEngine(networks, options)
