"""Live lip-sync: sessions that speak as their audio arrives, many on one GPU (engine.py says how)."""

from lipstream.live.engine import EngineStats, LiveEngine
from lipstream.live.items import LiveFrame, SessionStats, SpeechEvent
from lipstream.live.options import PRESETS, LiveOptions, preset
from lipstream.live.scheduler import AdmissionError
from lipstream.live.session import Session

__all__ = ["AdmissionError", "EngineStats", "LiveEngine", "LiveFrame", "LiveOptions", "PRESETS", "Session",
           "SessionStats", "SpeechEvent", "preset"]
