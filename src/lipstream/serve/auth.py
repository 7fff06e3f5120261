"""Who is calling: an API key to the owner id the caller's jobs and sessions are kept under, as
FastAPI dependencies (one check for every /v1 route, the WebSocket's too).

A server without keys (loopback only) has one owner, "", and every caller sees everything.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass

from fastapi import FastAPI, HTTPException, Request
from starlette.requests import HTTPConnection


def owner_of(key: str | None) -> str:
    """What the store keeps of a key: a hash, never the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:16] if key else ""


@dataclass(frozen=True)
class Caller:
    """`owner`: the id a caller's jobs and sessions are kept under. `keyed`: the server has keys, so a
    caller sees only what its own key made."""

    owner: str
    keyed: bool

    @property
    def scope(self) -> str | None:
        """The owner a store query is limited to (None: every owner's)."""
        return self.owner if self.keyed else None

    def sees(self, owner: str) -> bool:
        return not self.keyed or owner == self.owner


class ApiKeys:
    """The server's bearer keys, compared in constant time."""

    def __init__(self, keys: Iterable[str]):
        self._keys = [k.encode() for k in keys]

    def caller(self, authorization: str, token: str | None = None) -> Caller | None:
        """The caller of a valid key (from the header, or a WebSocket's ?token=), None if it is not one."""
        if not self._keys:
            return Caller("", keyed=False)
        scheme, _, given = authorization.partition(" ")
        given = given if scheme.lower() == "bearer" else (token or "")
        if not any(hmac.compare_digest(given.encode(), k) for k in self._keys):
            return None
        return Caller(owner_of(given), keyed=True)


def use_keys(app: FastAPI, keys: Iterable[str]) -> None:
    """The keys `app`'s routes check (set once, by create_app)."""
    app.state.api_keys = ApiKeys(keys)


def api_keys(conn: HTTPConnection) -> ApiKeys:
    return conn.app.state.api_keys


def caller_or_token(request: Request, token: str | None = None) -> Caller:
    """caller(), the key also taken as ?token=: for the GETs a browser makes without headers
    (EventSource, <video src>). Only the path is logged, never the query."""
    who = api_keys(request).caller(request.headers.get("authorization", ""), token)
    if who is None:
        raise HTTPException(401, "a valid API key is needed: Authorization: Bearer <key>",
                            headers={"WWW-Authenticate": "Bearer"})
    return who


def caller(request: Request) -> Caller:
    """The caller; 401 without a valid key (when the server has keys)."""
    return caller_or_token(request)
