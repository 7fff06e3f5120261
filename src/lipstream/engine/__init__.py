"""The GPU core: batches of frame requests -> blended frames."""

from lipstream.engine.runner import Engine, FrameRequest
from lipstream.engine.reference import CPUBlendEngine, ReferenceEngine, RGBEngine

__all__ = ["CPUBlendEngine", "Engine", "FrameRequest", "ReferenceEngine", "RGBEngine"]
