"""Media out: H.264 + AAC muxed in one pass, in-process (PyAV)."""

from lipstream.media.mp4 import MP4Writer

__all__ = ["MP4Writer"]
