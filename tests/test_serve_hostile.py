"""`lipstream serve` against a hostile client: keys kept out of the log, malformed speech-socket messages
answered with an error and a close code (never an unhandled exception), refused sockets told why, and
bodies bounded. A real server in its own process (its log is what is checked), real clients (websockets,
raw sockets, aiortc for the offers)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path

import httpx
import pytest

from lipstream.fixtures import speech_like
from lipstream.fixtures.avatar import tracked_avatar
from serve_process import serve_process

KEY = "hostile-key-0123456789abcdef"
OTHER_KEY = "other-tenant-key-fedcba9876543210"
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_models):
    """`lipstream serve` in its own process with two keys, one avatar: (URL, its log file)."""
    root = tmp_path_factory.mktemp("hostile")
    tracked_avatar(root, "anna", tiny_models.vae, tiny_models.fingerprints["vae"], width=320, height=180, seed=0)
    path = os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)
    threads = {k: v for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TMPDIR") if (v := os.environ.get(k))}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"), "PYTHONPATH": path,
           "HF_HUB_OFFLINE": "1", "LIPSTREAM_API_KEYS": f"{KEY},{OTHER_KEY}", **threads}
    log = root / "server.log"
    with serve_process(["--avatars", root / "avatars", "--data", root / "data", "--capacity-fps", "100",
                        "--rtc-workers", "1", "--playout-delay-ms", "300", "--random-weights", "--random-size", "tiny",
                        "--device", "cpu"], env, log) as url:
        yield url, log


async def _open_session(url: str, key: str = KEY):
    """An aiortc peer's offer posted: (peer connection, session id). Close the peer when done."""
    from aiortc import RTCPeerConnection

    pc = RTCPeerConnection()
    pc.addTransceiver("audio", direction="recvonly")
    pc.addTransceiver("video", direction="recvonly")
    await pc.setLocalDescription(await pc.createOffer())
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        r = await c.post("/v1/sessions", params={"avatar": "anna"}, content=pc.localDescription.sdp,
                         headers={"Authorization": f"Bearer {key}", "Content-Type": "application/sdp"})
    assert r.status_code == 201, r.text
    return pc, r.headers["x-session-id"]


async def _close_session(url: str, pc, sid: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        await c.delete(f"/v1/sessions/{sid}", headers={"Authorization": f"Bearer {KEY}"})
    await pc.close()


def _ws(url: str, sid: str, token: str | None = KEY) -> str:
    return "ws" + url[4:] + f"/v1/sessions/{sid}/speech" + ("" if token is None else f"?token={token}")


async def _closed_with(ws_url: str, *messages, limit_s: float = 20.0) -> tuple[int | None, str, list[dict]]:
    """Send `messages` on a speech socket and read until the server closes it: (close code, reason, the JSON
    messages that came first). A socket refused at the handshake raises websockets' InvalidStatus."""
    import websockets

    got: list[dict] = []
    async with websockets.connect(ws_url, max_size=None) as ws:
        try:
            for m in messages:
                await ws.send(m)
            async with asyncio.timeout(limit_s):
                async for m in ws:
                    got.append(json.loads(m))
        except websockets.ConnectionClosed:
            pass
        rcvd = ws.close_code, ws.close_reason
    return rcvd[0], rcvd[1] or "", got


async def _speaks(ws_url: str, limit_s: float = 40.0) -> set[str]:
    """One utterance over a fresh speech socket: the speech events that came back."""
    import websockets

    pcm = (speech_like(1.0, 16_000, seed=2) * 32767).astype("<i2").tobytes()
    kinds: set[str] = set()
    async with websockets.connect(ws_url) as ws:
        await ws.send(json.dumps({"type": "start", "rate": 16_000}))
        await ws.send(pcm)
        await ws.send(json.dumps({"type": "end"}))
        async with asyncio.timeout(limit_s):
            async for m in ws:
                event = json.loads(m)
                kinds.add(event.get("kind"))
                if event.get("kind") == "finished":
                    break
    return kinds


BAD_MESSAGES = [  # (what, message, close code)
    ("an odd number of PCM bytes", b"\x00\x01\x02", 1007),
    ("a JSON array", "[1, 2]", 1007),
    ("JSON null", "null", 1007),
    ("text that is not JSON", "hello", 1007),
    ("a rate that is a word", json.dumps({"type": "start", "rate": "fast"}), 1007),
    ("an infinite rate", '{"type": "start", "rate": Infinity}', 1007),
    ("a rate of 1e300", '{"type": "start", "rate": 1e300}', 1007),
    ("a rate out of range", json.dumps({"type": "start", "rate": 4000}), 1007),
    ("an unknown type", json.dumps({"type": "dance"}), 1003),
    ("a switch to no avatar", json.dumps({"type": "switch"}), 1007),
    ("a switch to an avatar that is a number", json.dumps({"type": "switch", "avatar": 3}), 1007),
    ("a message too big", b"\x00" * (600 * 1024), 1009),
]


@pytest.mark.slow
def test_malformed_speech_messages_get_an_error_and_a_close_code_and_the_server_plays_on(server):
    url, log = server

    async def run():
        pc, sid = await _open_session(url)
        try:
            answers = {}
            for what, message, _ in BAD_MESSAGES:
                answers[what] = await _closed_with(_ws(url, sid), message)
            kinds = await _speaks(_ws(url, sid))  # the same session still speaks, over a new socket
        finally:
            await _close_session(url, pc, sid)
        return answers, kinds

    answers, kinds = asyncio.run(run())
    for what, _, code in BAD_MESSAGES:
        got_code, reason, messages = answers[what]
        assert got_code == code and reason, (what, got_code, reason, messages)
        errors = [m for m in messages if m.get("type") == "error"]
        assert errors and all(len(m["message"]) < 200 for m in errors), (what, messages)
    assert "allowed" in answers["a rate of 1e300"][2][-1]["message"]
    assert {"started", "finished"} <= kinds, kinds
    assert httpx.get(f"{url}/readyz").json()["status"] == "ready"
    text = log.read_text()
    assert "Exception in ASGI application" not in text and "Traceback" not in text, text[-3000:]


@pytest.mark.slow
def test_refused_speech_sockets_are_told_why_by_a_close_code(server):
    url, _ = server

    async def run():
        pc, sid = await _open_session(url)
        try:
            return {what: await _closed_with(ws_url) for what, ws_url in [
                ("no key", _ws(url, sid, None)),
                ("a wrong key", _ws(url, sid, "not-a-key")),
                ("an unknown session", _ws(url, "0123456789abcdef")),
                ("another key's session", _ws(url, sid, OTHER_KEY)),
            ]}
        finally:
            await _close_session(url, pc, sid)

    answers = asyncio.run(run())
    expected = {"no key": 4401, "a wrong key": 4401, "an unknown session": 4404, "another key's session": 4404}
    for what, code in expected.items():
        got_code, reason, messages = answers[what]
        assert got_code == code and reason, (what, answers[what])
        assert messages and messages[-1]["type"] == "error", (what, messages)


@pytest.mark.slow
def test_no_api_key_reaches_the_servers_log(server):
    """Accepted and refused speech sockets, and a GET with ?token=: the log keeps their paths, never a key."""
    url, log = server

    import websockets

    async def knock(ws_url: str) -> None:
        """Connect, say a command, leave (a socket refused at the handshake, as an older server did: fine)."""
        try:
            async with websockets.connect(ws_url) as ws:
                await ws.send(json.dumps({"type": "end"}))
                await asyncio.sleep(0.2)
        except (websockets.InvalidStatus, websockets.ConnectionClosed):
            pass

    async def run():
        pc, sid = await _open_session(url)
        try:
            await knock(_ws(url, sid, KEY))  # accepted
            await knock(_ws(url, sid, OTHER_KEY))  # another tenant's key, refused
            await knock(_ws(url, sid, "wrong-key-not-in-any-log"))  # refused
        finally:
            await _close_session(url, pc, sid)
        httpx.get(f"{url}/v1/jobs/nothing/events?token={KEY}")
        return sid

    sid = asyncio.run(run())
    time.sleep(0.5)
    text = log.read_text()
    assert f"/v1/sessions/{sid}/speech" in text  # the sockets were logged, by their path
    for secret in (KEY, OTHER_KEY, "wrong-key-not-in-any-log", "token="):
        assert secret not in text, secret


def _raw_post(url: str, head: dict[str, str], body: bytes, wait_s: float = 10.0) -> int | None:
    """POST /v1/sessions over a raw socket with `head` as its headers and `body` (perhaps less than it
    announces): the status the server answered with within `wait_s`, None if it answered nothing."""
    host, port = url.rsplit("/", 1)[1].split(":")
    lines = ["POST /v1/sessions?avatar=anna HTTP/1.1", f"Host: {host}", f"Authorization: Bearer {KEY}",
             "Content-Type: application/sdp", *(f"{k}: {v}" for k, v in head.items())]
    with socket.create_connection((host, int(port)), timeout=wait_s) as s:
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        try:
            answer = s.recv(4096)
        except (socket.timeout, ConnectionError):
            return None
    return int(answer.split()[1]) if answer else None


def _chunked(data: bytes, size: int = 16 * 1024) -> bytes:
    return b"".join(f"{len(data[i:i + size]):x}\r\n".encode() + data[i:i + size] + b"\r\n"
                    for i in range(0, len(data), size))


@pytest.mark.slow
def test_a_session_offer_is_bounded_and_checked(server):
    url, _ = server
    # announced as 5 MiB, 1 KiB sent: refused by its length, not read
    assert _raw_post(url, {"Content-Length": str(5 * 2**20)}, b"v=0\r\n" + b"a" * 1024) == 413
    # chunked, no length: 128 KiB sent and never ended: refused once past the limit
    assert _raw_post(url, {"Transfer-Encoding": "chunked"}, _chunked(b"v=0\r\n" + b"a" * 128 * 1024)) == 413
    r = httpx.post(f"{url}/v1/sessions", params={"avatar": "anna"}, content=b"v=0\r\nnonsense\r\n",
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/sdp"}, timeout=30)
    assert r.status_code == 422, r.text
    detail = r.json()["detail"]
    assert detail.startswith("offer: not a valid SDP offer (") and "Error" not in detail and "None" not in detail, detail
    assert httpx.get(f"{url}/readyz").json()["status"] == "ready"


@pytest.mark.slow
def test_a_remote_session_whose_socket_the_server_closed_says_why(server):
    """lipstream.client: once the server has closed the speech socket (here: the session deleted by another
    client), pushing speech raises a LipStreamError with the server's reason, not a silent drop."""
    from lipstream.client import connect
    from lipstream.errors import LipStreamError

    url, _ = server

    async def run():
        session = await connect(url, "anna", api_key=KEY)
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                r = await c.delete(f"/v1/sessions/{session.id}", headers={"Authorization": f"Bearer {KEY}"})
                assert r.status_code == 204
            t = time.monotonic()
            while time.monotonic() - t < 10:
                try:
                    session.push_audio(speech_like(0.1, 16_000, seed=1), 16_000)
                except LipStreamError as e:
                    return str(e)
                await asyncio.sleep(0.1)
            return None
        finally:
            await session.aclose()

    error = asyncio.run(run())
    assert error is not None and "4410" in error and "ended" in error, error


def test_the_speech_sockets_messages_are_checked_in_one_place():
    """The check a plain server and a fleet's front share (serve/speech_socket.py): each malformed message a
    BadMessage with its close code and a short message naming what is allowed; good ones what they ask."""
    from lipstream.serve.speech_socket import Audio, BadMessage, Command, Start, Switch, speech_message

    def said(message):
        return speech_message({"bytes": message} if isinstance(message, bytes) else {"text": message})

    for what, message, code in BAD_MESSAGES:
        with pytest.raises(BadMessage) as e:
            said(message)
        assert e.value.code == code and "allowed" in e.value.message, what
        assert len(e.value.message) < 200 and len(e.value.reason.encode()) <= 123, what
    assert said(json.dumps({"type": "start", "rate": 44_100})) == Start(44_100)
    assert said(json.dumps({"type": "start"})) == Start(16_000)
    assert said(json.dumps({"type": "interrupt"})) == Command("interrupt")
    assert said(json.dumps({"type": "switch", "avatar": "close-up"})) == Switch("close-up")
    assert said(b"\x00\x01" * 100) == Audio(b"\x00\x01" * 100)


def test_the_log_keeps_paths_and_drops_their_queries():
    from lipstream.serve.logs import without_queries

    line = '127.0.0.1:5 - "WebSocket /v1/sessions/ab/speech?token=SECRET&x=1" 403'
    assert without_queries(line) == '127.0.0.1:5 - "WebSocket /v1/sessions/ab/speech" 403'
    assert without_queries("GET http://h:8/v1/jobs/1/events?token=SECRET 200") == "GET http://h:8/v1/jobs/1/events 200"


def test_an_offer_is_checked_before_webrtc_sees_it():
    from lipstream.serve.offers import offer_problem

    good = ("v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\na=group:BUNDLE 0\r\n"
            "m=video 9 UDP/TLS/RTP/SAVPF 96\r\nc=IN IP4 0.0.0.0\r\na=mid:0\r\na=ice-ufrag:abcd\r\n"
            "a=ice-pwd:0123456789abcdef01234567\r\na=fingerprint:sha-256 AB:CD\r\na=setup:actpass\r\n"
            "a=recvonly\r\na=rtpmap:96 VP8/90000\r\n")
    assert offer_problem(good) is None
    assert offer_problem("v=0\r\nnonsense\r\n") == "line 2 is not type=value"
    assert offer_problem("hello") == "it must begin with v=0"
    assert offer_problem(good.replace("a=ice-pwd:0123456789abcdef01234567\r\n", "")) == "it has no ice-pwd"
    assert "no m= line" in offer_problem(good.split("m=video")[0])


@pytest.mark.slow
def test_another_keys_session_is_not_there_for_listing_reading_or_closing(server):
    """Per-key isolation of live sessions over HTTP: another key's list leaves the session out, and its GET
    and DELETE answer 404 as for a session that does not exist (and the session plays on after)."""
    url, _ = server

    async def run():
        pc, sid = await _open_session(url)
        other = {"Authorization": f"Bearer {OTHER_KEY}"}
        mine = {"Authorization": f"Bearer {KEY}"}
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:
                listed = (await c.get("/v1/sessions", headers=other)).json()
                read = (await c.get(f"/v1/sessions/{sid}", headers=other)).status_code
                closed = (await c.delete(f"/v1/sessions/{sid}", headers=other)).status_code
                still = (await c.get(f"/v1/sessions/{sid}", headers=mine)).status_code
            return sid, listed, read, closed, still
        finally:
            await _close_session(url, pc, sid)

    sid, listed, read, closed, still = asyncio.run(run())
    assert sid not in json.dumps(listed), listed
    assert (read, closed, still) == (404, 404, 200)
