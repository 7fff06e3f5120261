"""/v1/sessions: live presenters over WebRTC (opened with the client's SDP offer, listed, closed)
and the WebSocket that streams a session's speech in. The sessions are serve/live.py's."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np
from fastapi import APIRouter, Depends, HTTPException, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response

from lipstream.live import AdmissionError
from lipstream.rates import as_fps
from lipstream.serve.auth import ApiKeys, Caller, api_keys, caller
from lipstream.serve.live import LiveSession
from lipstream.serve.options import RETRY_AFTER_S
from lipstream.serve.routes_avatars import known_avatar
from lipstream.serve.service import Service
from lipstream.serve.state import get_service

router = APIRouter()


def own_session(service: Service, sid: str, who: Caller) -> LiveSession:
    live = service.sessions.open.get(sid)
    if live is None or not who.sees(live.owner):
        raise HTTPException(404, f"no live session {sid}")
    return live


@router.post("/v1/sessions", status_code=201)
async def open_session(request: Request, avatar: str, playout_delay_ms: float | None = None, fps: str | None = None,
                       who: Caller = Depends(caller), service: Service = Depends(get_service)) -> Response:
    """A live presenter over WebRTC: the body is the client's SDP offer (application/sdp), the
    answer comes back with the session's Location (DELETE it to end); speech goes to
    /v1/sessions/{id}/speech (a WebSocket) or comes as the offer's own audio track.
    `playout_delay_ms`: how far behind the speech this session plays (default: the server's);
    less is sooner, with more frames at risk of being late under load. `fps` ("25", "30000/1001"; default:
    the avatar's): the session's own frame rate."""
    sessions = service.sessions
    known_avatar(service, avatar)
    if playout_delay_ms is not None and not 50 <= playout_delay_ms <= 5000:
        raise HTTPException(422, f"playout_delay_ms: {playout_delay_ms:g}; 50 to 5000 is allowed")
    try:
        rate = None if fps is None else as_fps(fps)
    except ValueError as e:
        raise HTTPException(422, f"fps: {e}") from None
    if rate is not None and not 1 <= rate <= 60:
        raise HTTPException(422, f"fps: {fps}; 1 to 60 is allowed")
    if sessions.count(who.owner) >= service.o.sessions_per_key:
        raise HTTPException(429, f"this key has {service.o.sessions_per_key} live sessions open already",
                            headers={"Retry-After": str(RETRY_AFTER_S)})
    offer = (await request.body()).decode("utf-8", "replace")
    if "v=0" not in offer:
        raise HTTPException(422, "the body must be an SDP offer (Content-Type: application/sdp)")
    try:
        live, answer = await sessions.start(who.owner, avatar, offer,
                                            None if playout_delay_ms is None else playout_delay_ms / 1000, rate)
    except AdmissionError as e:
        raise HTTPException(503, str(e), headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except ValueError as e:
        raise HTTPException(422, f"offer: {str(e).splitlines()[0]}") from None
    except RuntimeError as e:  # its WebRTC worker died under it: a new one takes the next session
        raise HTTPException(503, str(e), headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    return Response(answer, 201, media_type="application/sdp",
                    headers={"Location": f"/v1/sessions/{live.id}", "X-Session-Id": live.id})


@router.get("/v1/sessions")
def list_sessions(who: Caller = Depends(caller), service: Service = Depends(get_service)) -> list[dict]:
    return [{"id": x.id, "avatar": x.avatar, "frames_played": x.session.stats.played,
             "frames_late": x.session.stats.late} for x in service.sessions.open.values() if who.sees(x.owner)]


@router.get("/v1/sessions/{sid}")
def session_status(sid: str, who: Caller = Depends(caller), service: Service = Depends(get_service)) -> dict:
    """One session's counters and, per speech frame kept, where its time went (ms by stage:
    audio arriving, features and scheduling, render, encode, slack before its deadline)."""
    live = own_session(service, sid, who)
    s = live.session
    return {"id": live.id, "avatar": live.avatar, "playout_delay_ms": round(s.o.playout_delay_s * 1000, 1),
            "video": "h264" if live.encoded else "vp8", "stats": dataclasses.asdict(s.stats),
            "timings_ms": s.timings_ms()}


@router.delete("/v1/sessions/{sid}", status_code=204)
async def close_session(sid: str, who: Caller = Depends(caller), service: Service = Depends(get_service)) -> Response:
    own_session(service, sid, who)
    await service.sessions.close(sid)
    return Response(status_code=204)


@router.websocket("/v1/sessions/{sid}/speech")
async def speech(ws: WebSocket, sid: str, token: str | None = None, keys: ApiKeys = Depends(api_keys),
                 service: Service = Depends(get_service)) -> None:
    """Binary messages: PCM16 mono at `rate` (a first {"type": "start", "rate": 16000}; 16 kHz if
    none); {"type": "end"} ends an utterance, {"type": "interrupt"} cuts it off; speech events
    (started / finished / interrupted, at playout) come back as JSON."""
    sessions = service.sessions
    who = keys.caller(ws.headers.get("authorization", ""), token)
    live = sessions.open.get(sid)
    if who is None or live is None or not who.sees(live.owner):
        await ws.close(code=4401 if who is None else 4404)
        return
    await ws.accept()
    rate = 16_000

    async def send_events() -> None:
        while True:
            await ws.send_json(await live.events.get())

    sender = asyncio.ensure_future(send_events())
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            if sessions.open.get(sid) is not live:  # the session ended under the socket (its client left)
                await ws.close(code=4410, reason="the session has ended")
                break
            if message.get("bytes") is not None:
                pcm = np.frombuffer(message["bytes"], "<i2")
                if pcm.size:
                    live.session.push_audio(pcm, rate)
                continue
            try:
                command = json.loads(message.get("text") or "{}")
            except json.JSONDecodeError:
                command = {}
            kind = command.get("type")
            if kind == "start":
                rate = int(command.get("rate", 16_000))
                if not 8000 <= rate <= 192_000:
                    await ws.send_json({"type": "error", "message": f"rate {rate}: 8000 to 192000 Hz"})
                    rate = 16_000
            elif kind == "end":
                live.session.end_utterance()
            elif kind == "interrupt":
                live.session.clear()
            else:
                await ws.send_json({"type": "error", "message": "expected start, end or interrupt"})
    except WebSocketDisconnect:
        pass
    finally:
        sender.cancel()
