"""Media out: every encoder (the MP4 file writer, live sessions' encoders) and the worker processes they run in."""

from lipstream import lazy_names

__all__ = ["MP4Writer"]
# lazy: a remote client's audio probe (media.demux) needs PyAV only, not the writer's numpy and pools
__getattr__ = lazy_names(__name__, globals(), {"MP4Writer": "mp4"})
