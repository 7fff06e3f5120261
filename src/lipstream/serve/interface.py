"""What the HTTP app needs of the server behind it, as interfaces: one process (serve/service.py's
Service with its LiveSessions) and a fleet of engine replicas under Ray Serve (serve/fleet/front.py's
FleetFront) both play these roles, so the routes are the same code and the API is the same.

Jobs need nothing here beyond the shared job store and data folder: runners pull their jobs from
the store, wherever they run.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from lipstream.serve.auth import Caller
    from lipstream.serve.options import ServeOptions
    from lipstream.serve.store.base import JobStore


class SessionGone(Exception):
    """The session ended under its speech socket (closed, or its replica died)."""


class SpeechLink(Protocol):
    """One session's speech in and speech events out, as the WebSocket route drives them."""

    async def push(self, pcm16: bytes, rate: int) -> None: ...  # SessionGone once the session has ended

    async def command(self, kind: str) -> None: ...  # "end" (the utterance) or "interrupt"

    async def switch(self, avatar: str) -> None: ...  # a camera cut; answered by a "switched" or "switch_refused" event

    def events(self) -> AsyncIterator[dict]: ...  # speech events as the socket sends them


class SessionHost(Protocol):
    """The live sessions of a server: a session id is all a later request needs to reach its session."""

    async def open_for(self, owner: str, avatar: str, offer: str, playout_delay_s: float | None,
                       fps: Fraction | None, latency: str | None = None) -> tuple[str, str]:
        """(session id, SDP answer); SessionRefused when it cannot be opened."""
        ...

    async def owned(self, owner: str) -> int: ...

    async def listing(self, who: Caller) -> list[dict]: ...

    async def status(self, sid: str, who: Caller) -> dict | None: ...

    async def close_for(self, sid: str, who: Caller) -> bool: ...

    async def speech(self, sid: str, who: Caller) -> SpeechLink | None: ...


class ServerHost(Protocol):
    """The server behind the routes (app.state.service)."""

    o: ServeOptions
    store: JobStore
    uploads_dir: Path
    results_dir: Path
    sessions: SessionHost

    def is_ready(self) -> bool: ...

    def failure(self) -> str | None: ...  # why this server can serve nothing any more (its engine stopped), or None

    def has_avatar(self, name: str) -> bool: ...

    async def avatar_list(self) -> list[dict]: ...  # as GET /v1/avatars lists them

    def wake_runner(self) -> None: ...  # a job was submitted

    def count_request(self, route: str, status: int) -> None: ...

    async def metrics_text(self) -> bytes: ...

    async def start_serving(self) -> None: ...  # the app's lifespan: started, then stopped

    async def stop_serving(self) -> None: ...
