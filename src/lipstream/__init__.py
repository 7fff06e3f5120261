"""LipStream: MuseTalk v1.5 lip-sync, end to end on the GPU, streaming."""

from lipstream.errors import LipStreamError

__version__ = "0.1.0"
__all__ = ["LipStreamError", "__version__"]
