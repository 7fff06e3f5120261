"""/v1/sessions: live presenters over WebRTC (opened with the client's SDP offer, listed, closed)
and the WebSocket that streams a session's speech in. The sessions are the server's SessionHost
(serve/interface.py): this process's (serve/live.py) or a fleet's (serve/fleet/front.py)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, HTTPException, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response
from starlette.websockets import WebSocketState

from lipstream.live.options import SESSION_LATENCY
from lipstream.media.rates import as_fps
from lipstream.serve.auth import ApiKeys, Caller, api_keys, caller
from lipstream.live.interface import SessionRefused
from lipstream.serve.interface import ServerHost, SessionGone
from lipstream.serve.offers import offer_problem
from lipstream.serve.options import RETRY_AFTER_S
from lipstream.serve.routes.avatars import known_avatar
from lipstream.serve.speech_socket import (DEFAULT_RATE, ENDED, NO_KEY, NO_SESSION, Audio, BadMessage, Start,
                                           Switch, close_reason, speech_message)
from lipstream.serve.state import get_service

router = APIRouter()


@router.post("/v1/sessions", status_code=201)
async def open_session(request: Request, avatar: str, playout_delay_ms: float | None = None, fps: str | None = None,
                       latency: str | None = None, who: Caller = Depends(caller),
                       service: ServerHost = Depends(get_service)) -> Response:
    """A live presenter over WebRTC: the body is the client's SDP offer (application/sdp), the
    answer comes back with the session's Location (DELETE it to end); speech goes to
    /v1/sessions/{id}/speech (a WebSocket) or comes as the offer's own audio track.
    `playout_delay_ms`: how far behind the speech this session plays (default: the server's);
    less is sooner, with more frames at risk of being late under load. `fps` ("25", "30000/1001"; default:
    the avatar's): the session's own frame rate. `latency` ("low"; default: the server's): "low" plays
    0.12 s behind the speech and renders a frame once its own audio is in (docs/live.md, "Low latency");
    `playout_delay_ms` goes over its delay."""
    sessions = service.sessions
    known_avatar(service, avatar)
    if latency is not None and latency not in SESSION_LATENCY:
        raise HTTPException(422, f"latency: {latency!r}; {' or '.join(map(repr, SESSION_LATENCY))} is allowed")
    if playout_delay_ms is not None and not 50 <= playout_delay_ms <= 5000:
        raise HTTPException(422, f"playout_delay_ms: {playout_delay_ms:g}; 50 to 5000 is allowed")
    try:
        rate = None if fps is None else as_fps(fps)
    except ValueError as e:
        raise HTTPException(422, f"fps: {e}") from None
    if rate is not None and not 1 <= rate <= 60:
        raise HTTPException(422, f"fps: {fps}; 1 to 60 is allowed")
    if await sessions.owned(who.owner) >= service.o.sessions_per_key:
        raise HTTPException(429, f"this key has {service.o.sessions_per_key} live sessions open already",
                            headers={"Retry-After": str(RETRY_AFTER_S)})
    offer = (await request.body()).decode("utf-8", "replace")  # bounded: 64 KiB (serve/bodies.py)
    problem = offer_problem(offer)
    if problem is not None:
        raise HTTPException(422, f"offer: not a valid SDP offer ({problem}); the body must be one "
                                 "(Content-Type: application/sdp)")
    try:
        sid, answer = await sessions.open_for(who.owner, avatar, offer,
                                              None if playout_delay_ms is None else playout_delay_ms / 1000, rate,
                                              latency)
    except SessionRefused as e:  # 503 (full: every replica of a fleet; or no WebRTC worker) or 422
        raise HTTPException(e.status, e.detail,
                            headers={"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None) from None
    return Response(answer, 201, media_type="application/sdp",
                    headers={"Location": f"/v1/sessions/{sid}", "X-Session-Id": sid})


@router.get("/v1/sessions")
async def list_sessions(who: Caller = Depends(caller), service: ServerHost = Depends(get_service)) -> list[dict]:
    return await service.sessions.listing(who)


@router.get("/v1/sessions/{sid}")
async def session_status(sid: str, who: Caller = Depends(caller),
                         service: ServerHost = Depends(get_service)) -> dict:
    """One session's counters and, per speech frame kept, where its time went (ms by stage:
    audio arriving, features and scheduling, render, encode, slack before its deadline)."""
    status = await service.sessions.status(sid, who)
    if status is None:
        raise HTTPException(404, f"no live session {sid}")
    return status


@router.delete("/v1/sessions/{sid}", status_code=204)
async def close_session(sid: str, who: Caller = Depends(caller),
                        service: ServerHost = Depends(get_service)) -> Response:
    if not await service.sessions.close_for(sid, who):
        raise HTTPException(404, f"no live session {sid}")
    return Response(status_code=204)


@router.websocket("/v1/sessions/{sid}/speech")
async def speech(ws: WebSocket, sid: str, token: str | None = None, keys: ApiKeys = Depends(api_keys),
                 service: ServerHost = Depends(get_service)) -> None:
    """Binary messages: PCM16 mono at `rate` (a first {"type": "start", "rate": 16000}; 16 kHz if
    none); {"type": "end"} ends an utterance, {"type": "interrupt"} cuts it off, {"type": "switch",
    "avatar": NAME} cuts to another camera (answered {"type": "switched"} or {"type": "switch_refused"});
    speech events (started / finished / interrupted, at playout) come back as JSON. A refused socket (4401, 4404) or a
    malformed message (1003, 1007, 1009: serve/speech_socket.py) gets {"type": "error"} and a close
    with that code and a reason."""
    who = keys.caller(ws.headers.get("authorization", ""), token)
    link = None if who is None else await service.sessions.speech(sid, who)
    await ws.accept()  # then refused by a close code: closed before accept, a client sees only a bare 403
    if link is None:
        await _refuse(ws, BadMessage(NO_KEY, "a valid API key is needed: ?token=KEY or Authorization: Bearer KEY")
                      if who is None else BadMessage(NO_SESSION, f"no live session {sid} for this key"))
        return
    rate = DEFAULT_RATE

    async def send_events() -> None:
        reason = "the session has ended"
        async for event in link.events():
            await ws.send_json(event)
            if event.get("type") == "ended":  # the server ended it (a worker process died, say): why
                reason = f"the session has ended: {event.get('reason', '')}"
        # the events end with the session (a fleet's replica that died, say): the socket with them
        await _ended(ws, reason)

    sender = asyncio.ensure_future(send_events())
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                break
            try:
                said = speech_message(message)
            except BadMessage as e:
                await _refuse(ws, e)
                break
            if isinstance(said, Audio):
                await link.push(said.pcm16, rate)
            elif isinstance(said, Start):
                rate = said.rate
            elif isinstance(said, Switch):
                await link.switch(said.avatar)
            else:
                await link.command(said.kind)
    except SessionGone:  # the session ended under the socket (its client left, its replica died)
        await _ended(ws)
    except WebSocketDisconnect:
        pass
    finally:
        sender.cancel()


async def _refuse(ws: WebSocket, why: BadMessage) -> None:
    """{"type": "error", "message": ...}, then a close with `why`'s code and reason."""
    try:
        await ws.send_json({"type": "error", "code": why.code, "message": why.message})
        await ws.close(code=why.code, reason=why.reason)
    except (RuntimeError, WebSocketDisconnect):  # the client left first
        pass


async def _ended(ws: WebSocket, reason: str = "the session has ended") -> None:
    """Close the socket with 4410 unless it is closed already (its events and its reader both see the end)."""
    if ws.application_state == WebSocketState.CONNECTED and ws.client_state == WebSocketState.CONNECTED:
        try:
            await ws.close(code=ENDED, reason=close_reason(reason))
        except (RuntimeError, WebSocketDisconnect):
            pass
