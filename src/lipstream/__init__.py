"""LipStream: MuseTalk v1.5 lip-sync for AI presenters on the GPU; a package per stage (docs/ARCHITECTURE.md)."""

from lipstream.errors import LipStreamError

__version__ = "0.1.0"
__all__ = ["LipStreamError", "__version__"]
