"""The ports a server is about to listen on: a taken --port is one line before anything loads, and a fleet
behind HAProxy moves HAProxy's stats and metrics off ports something else holds (a second fleet on the machine)."""

from __future__ import annotations

import socket

import pytest

from lipstream.serve.ports import (HAPROXY_SIDE_PORTS, bind_error, check_haproxy_ports, check_port, free_port,
                                   haproxy_side_ports)


@pytest.fixture
def listening():
    """A port something listens on, at 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_taken_port_is_named_with_its_address(listening):
    with pytest.raises(ValueError, match=rf"^--port {listening}: 127.0.0.1:{listening} is already in use"):
        check_port("127.0.0.1", listening)
    with pytest.raises(ValueError, match="already in use"):  # all interfaces include the one taken
        check_port("0.0.0.0", listening)


def test_a_free_port_and_port_zero_pass():
    check_port("127.0.0.1", free_port("127.0.0.1"))
    check_port("127.0.0.1", 0)
    assert bind_error("127.0.0.1", 0) is None


def test_a_closed_connections_time_wait_does_not_count():
    """uvicorn binds with SO_REUSEADDR: a port its last run's connections still wait on (TIME_WAIT) is free
    to its next run."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's: its connections inherit it
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server's side closes first: its end waits in TIME_WAIT
        client.close()
    check_port("127.0.0.1", port)


def test_an_address_not_of_this_machine_is_named():
    with pytest.raises(ValueError, match=r"^--host 192\.0\.2\.77: not an address of this machine"):
        check_port("192.0.2.77", 8000)  # TEST-NET-1: never a local address


def test_haproxys_side_ports_move_off_taken_ones_and_keep_the_users(listening):
    (stats, stats_default), (metrics, metrics_default) = HAPROXY_SIDE_PORTS["stats"], HAPROXY_SIDE_PORTS["metrics"]
    held = []
    try:
        for port in (stats_default, metrics_default):  # held here, or by something else already: taken either way
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("0.0.0.0", port))
                s.listen()
            except OSError:
                pass
            held.append(s)
        chosen = haproxy_side_ports({}, server_port=listening)
        assert set(chosen) == {stats, metrics}
        ports = {int(p) for p in chosen.values()}
        assert len(ports) == 2 and not ports & {stats_default, metrics_default, listening}, chosen
        assert all(bind_error("0.0.0.0", p) is None for p in ports)
        assert haproxy_side_ports({stats: "18404"}, server_port=listening).keys() == {metrics}  # the user's kept
    finally:
        for s in held:
            s.close()
    mine = free_port()
    assert haproxy_side_ports({metrics: "1"}, server_port=mine)[stats] != str(mine)


def test_a_haproxy_port_the_user_set_is_checked_before_anything_starts(listening):
    stats = HAPROXY_SIDE_PORTS["stats"][0]
    check_haproxy_ports(8000, {})
    check_haproxy_ports(8000, {stats: str(free_port())})
    with pytest.raises(ValueError, match=rf"^{stats}={listening}: 0.0.0.0:{listening} is already in use"):
        check_haproxy_ports(8000, {stats: str(listening)})
    for bad in ("abc", "0", "70000", "8000"):  # 8000: the server's own
        with pytest.raises(ValueError, match=rf"^{stats}='{bad}': a port from 1 to 65535"):
            check_haproxy_ports(8000, {stats: bad})
