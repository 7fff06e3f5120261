"""Everything that talks to a running `lipstream serve`: live sessions over WebRTC and jobs over HTTP.

session.py: `session = await connect(url, "anna")`, a RemoteSession that plays `live.SpeakingSession` as a
local session does. jobs.py and upload.py: `lipstream render --server URL` (a job's inputs checked, uploaded,
followed and downloaded atomically). Never imports the server (serve/), nor torch: a client costs what a
client costs. The names load on first use (PEP 562).
"""

from __future__ import annotations

from lipstream import lazy_names

_LAZY = {"connect": "session", "RemoteSession": "session", "SessionRefused": "session", "JobServer": "jobs",
         "RemoteError": "jobs", "run_job": "jobs"}

__all__ = sorted(_LAZY)


__getattr__ = lazy_names(__name__, globals(), _LAZY)
