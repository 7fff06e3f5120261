"""Media out: every encoder (the MP4 file writer, live sessions' encoders) and the worker processes they run in."""

from lipstream.media.mp4 import MP4Writer

__all__ = ["MP4Writer"]
