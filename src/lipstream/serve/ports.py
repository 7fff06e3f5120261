"""The ports a server is about to listen on (and HAProxy's, behind a fleet), looked at before anything starts.

uvicorn (a plain server) and Ray Serve's ingress (a fleet) find a taken port only when they bind it, after the
networks or Ray have started: uvicorn's error comes 5-20 s in, Ray's as a stack trace. Asked here first, it is
one line naming --port. A race with another process taking the port in between still fails at the bind.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping

# `--ingress haproxy`: HAProxy also serves its stats page and Prometheus metrics, on every interface, at Ray's
# fixed ports: a second fleet on the machine (or anything else there) made HAProxy exit at start, and the server
# with it. Those ports where free, else ones the system gives; a port set in the environment is the user's.
HAPROXY_SIDE_PORTS = {"stats": ("RAY_SERVE_HAPROXY_STATS_PORT", 8404), "metrics": ("RAY_SERVE_HAPROXY_METRICS_PORT", 9101)}


def family_of(host: str) -> socket.AddressFamily:
    """The address family uvicorn binds `host` with (a colon: IPv6)."""
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on (host, port) now, or None: another one listening there (or on the
    wildcard address), an address not of this machine, a port it may not open. SO_REUSEADDR as uvicorn and
    HAProxy set it, so a closed connection's TIME_WAIT does not count. Port 0 (the system picks) is free."""
    if port == 0:
        return None
    with socket.socket(family_of(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None


def free_port(host: str = "0.0.0.0") -> int:
    """A port the system has no listener on for `host` now."""
    with socket.socket(family_of(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port(host: str, port: int) -> None:
    """ValueError in one line when --host/--port cannot be listened on, saying why."""
    e = bind_error(host, port)
    if e is None:
        return
    if isinstance(e, socket.gaierror):
        raise ValueError(f"--host {host!r}: not a name or address this machine can resolve")
    if e.errno == errno.EADDRINUSE:
        raise ValueError(f"--port {port}: {host}:{port} is already in use (another server there?); "
                         "stop it or choose another --port")
    if e.errno == errno.EADDRNOTAVAIL:
        raise ValueError(f"--host {host}: not an address of this machine (0.0.0.0 listens on all of them)")
    if e.errno == errno.EACCES:
        raise ValueError(f"--port {port}: this user may not listen on it (ports below 1024 need privileges)")
    raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})")


def haproxy_side_ports(environ: Mapping[str, str], server_port: int) -> dict[str, str]:
    """HAProxy's stats and metrics ports not set in `environ`: Ray's defaults where nothing listens (nor will:
    the server's own port), else free ones (HAPROXY_SIDE_PORTS)."""
    chosen: dict[str, str] = {}
    for name, default in HAPROXY_SIDE_PORTS.values():
        if name not in environ:
            port = default
            while port == server_port or str(port) in chosen.values() or bind_error("0.0.0.0", port) is not None:
                port = free_port()
            chosen[name] = str(port)
    return chosen


def check_haproxy_ports(server_port: int, environ: Mapping[str, str] = os.environ) -> None:
    """ValueError in one line when a side port the user set for HAProxy cannot be listened on."""
    for name, _ in HAPROXY_SIDE_PORTS.values():
        if name in environ:
            value = environ[name]
            if not value.isdigit() or not 1 <= int(value) <= 65535 or int(value) == server_port:
                raise ValueError(f"{name}={value!r}: a port from 1 to 65535, not --port's, is allowed")
            if bind_error("0.0.0.0", int(value)) is not None:
                raise ValueError(f"{name}={value}: 0.0.0.0:{value} is already in use (or not to be opened by this "
                                 "user); unset it and the fleet takes a free one, or choose another")
