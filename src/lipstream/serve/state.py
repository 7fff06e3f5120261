"""The server behind the app (a ServerHost: serve/interface.py) on app.state: set once by create_app,
handed to routes as a FastAPI dependency, so that the routers are plain modules and not closures over it."""

from __future__ import annotations

from fastapi import FastAPI
from starlette.requests import HTTPConnection

from lipstream.serve.interface import ServerHost


def use_service(app: FastAPI, service: ServerHost) -> None:
    app.state.service = service


def get_service(conn: HTTPConnection) -> ServerHost:
    """The app's server (a request's or a WebSocket's)."""
    return conn.app.state.service
