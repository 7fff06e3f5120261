"""Live lip-sync: sessions that speak as their audio arrives, many on one GPU (engine.py says how).

The stable surface (docs/live.md): `start_engine` and `LiveEngine` (avatars, `open_session`),
`Session` (`push_audio`, `end_utterance`, `clear`, `async for item in session`, `rgb`, `close`),
what it hands out (`LiveFrame`, `SpeechEvent`), `LiveOptions` and its presets, and `SpeakingSession`,
the interface a local and a remote session share.

The engine's names load on first use (PEP 562): what a session hands out and the interface
(items.py, interface.py) import without torch, for a remote client (lipstream.client).
"""

from __future__ import annotations

from lipstream import lazy_names
from lipstream.live.interface import SessionRefused, SpeakingSession
from lipstream.live.items import LiveFrame, SessionStats, SpeechEvent

_LAZY = {"EngineStats": "core", "LiveEngine": "engine", "start_engine": "engine", "LiveOptions": "options",
         "PRESETS": "options", "preset": "options", "Session": "session"}

__all__ = ["EngineStats", "LiveEngine", "LiveFrame", "LiveOptions", "PRESETS", "Session",
           "SessionRefused", "SessionStats", "SpeakingSession", "SpeechEvent", "preset", "start_engine"]


__getattr__ = lazy_names(__name__, globals(), _LAZY)
