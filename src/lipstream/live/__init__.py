"""Live lip-sync: sessions that speak as the audio arrives, many per GPU (engine.py says how)."""

from lipstream.live.engine import EngineStats, LiveEngine
from lipstream.live.options import PRESETS, LiveOptions, preset
from lipstream.live.scheduler import AdmissionError
from lipstream.live.session import LiveFrame, Session, SessionStats, SpeechEvent

__all__ = ["AdmissionError", "EngineStats", "LiveEngine", "LiveFrame", "LiveOptions", "PRESETS", "Session",
           "SessionStats", "SpeechEvent", "preset"]
