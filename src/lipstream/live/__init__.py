"""Live lip-sync: sessions that speak as their audio arrives, many on one GPU (engine.py says how).

The stable surface (README: "The live session API"): `start_engine` and `LiveEngine` (avatars, `open_session`),
`Session` (`push_audio`, `end_utterance`, `clear`, `async for item in session`, `rgb`, `close`),
what it hands out (`LiveFrame`, `SpeechEvent`), `LiveOptions` and its presets, and `SpeakingSession`,
the interface a local and a remote session share.
"""

from lipstream.live.engine import EngineStats, LiveEngine, start_engine
from lipstream.live.interface import SpeakingSession
from lipstream.live.items import LiveFrame, SessionStats, SpeechEvent
from lipstream.live.options import PRESETS, LiveOptions, preset
from lipstream.live.scheduler import AdmissionError
from lipstream.live.session import Session

__all__ = ["AdmissionError", "EngineStats", "LiveEngine", "LiveFrame", "LiveOptions", "PRESETS", "Session",
           "SessionStats", "SpeakingSession", "SpeechEvent", "preset", "start_engine"]
