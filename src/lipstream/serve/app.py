"""The HTTP API of `lipstream serve` (FastAPI): render jobs, their progress and results, health, metrics,
and the web page at / (static files, no build step).

Every /v1 route takes a bearer key when the server has keys. Uploads are bounded before they are
read (Content-Length) and their audio by duration once stored; an avatar is named, never a path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import os
import shutil
import time
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
from fastapi import Depends, FastAPI, File, Form, HTTPException, Request, UploadFile, WebSocket, WebSocketDisconnect
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from lipstream.live import AdmissionError
from lipstream.serve.live import LiveSessions
from lipstream.serve.options import AVATAR_NAME
from lipstream.serve.rtc import default_workers
from lipstream.serve.service import Service, owner_of
from lipstream.serve.store import Job
from lipstream.serve.uploads import (AUDIO_SUFFIXES, VIDEO_SUFFIXES, audio_seconds, new_upload_folder,
                                     refused_by_length, save_upload)

log = logging.getLogger("lipstream.serve")
TERMINAL = ("done", "failed", "cancelled")
RETRY_AFTER_S = 5
SSE_POLL_S = 0.1
STATIC = Path(__file__).with_name("static")
PAGE_CSP = "default-src 'self'"  # the page loads nothing from elsewhere (its WebSocket is same-origin too)


def create_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await sessions.start_workers()
        yield
        await sessions.close_all()
        await asyncio.to_thread(service.stop)  # SIGTERM: the running job requeued, sessions closed

    app = FastAPI(title="LipStream", version="0.1", lifespan=lifespan,
                  description="MuseTalk lip-sync as a service: render jobs and live presenter sessions.")
    keys = [k.encode() for k in service.o.api_keys]
    sessions = service.sessions = LiveSessions(service, service.o.rtc_workers or default_workers())

    @app.middleware("http")
    async def count(request: Request, call_next):
        t = time.perf_counter()
        response = refused_by_length(request, service.o.max_upload_mb) or await call_next(request)
        if request.url.path == "/" or request.url.path.startswith("/static/"):
            response.headers["Cache-Control"] = "no-cache"  # revalidated: an upgraded server's page shows at once
        route = request.scope.get("route")
        service.metrics.requests.labels(getattr(route, "path", "other"), str(response.status_code)).inc()
        log.info(json.dumps({"event": "request", "method": request.method, "path": request.url.path,
                             "status": response.status_code, "ms": round(1000 * (time.perf_counter() - t), 1)}))
        return response

    def key_owner(authorization: str, token: str | None = None) -> str | None:
        """The owner of a valid key (from the header, or a WebSocket's ?token=), None if it is not one."""
        if not keys:
            return ""
        scheme, _, given = authorization.partition(" ")
        given = given if scheme.lower() == "bearer" else (token or "")
        return owner_of(given) if any(hmac.compare_digest(given.encode(), k) for k in keys) else None

    def owner_or_token(request: Request, token: str | None = None) -> str:
        """owner(), the key also taken as ?token=: for the GETs a browser makes without headers
        (EventSource, <video src>). Only the path is logged, never the query."""
        who = key_owner(request.headers.get("authorization", ""), token)
        if who is None:
            raise HTTPException(401, "a valid API key is needed: Authorization: Bearer <key>",
                                headers={"WWW-Authenticate": "Bearer"})
        return who

    def owner(request: Request) -> str:
        """The caller's owner id; 401 without a valid key (when the server has keys)."""
        return owner_or_token(request)

    def job_json(job: Job) -> dict:
        out = {"id": job.id, "kind": job.kind, "status": job.status, "progress": round(job.progress, 4),
               "error": job.error, "created_at": job.created_at, "started_at": job.started_at,
               "finished_at": job.finished_at, "avatar": job.params.get("avatar")}
        if job.status == "done":
            out["result"] = f"/v1/jobs/{job.id}/result"
        return out

    def known_avatar(name: str) -> None:
        if not AVATAR_NAME.fullmatch(name):
            raise HTTPException(422, "avatar: a name of letters, digits, '_', '.' and '-' is allowed")
        if name not in service.avatars:
            raise HTTPException(404, f"avatar {name!r} is not resident (GET /v1/avatars lists them)")

    def check_cap(who: str) -> None:
        if service.store.active(who) >= service.o.jobs_per_key:
            raise HTTPException(429, f"this key has {service.o.jobs_per_key} jobs queued or running already",
                                headers={"Retry-After": str(RETRY_AFTER_S)})

    def own_job(job_id: str, who: str) -> Job:
        job = service.store.get(job_id, who if keys else None)
        if job is None:
            raise HTTPException(404, f"no job {job_id}")
        return job

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": PAGE_CSP})

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> Response:
        if not service.ready:
            return JSONResponse({"status": "starting"}, 503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return JSONResponse({"status": "ready", "avatars": len(service.avatars)})

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(service.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/avatars")
    def avatars(who: str = Depends(owner)) -> list[dict]:
        out = []
        for name, slot in sorted(service.avatars.items()):
            a = service.live.engine.avatars[slot]
            out.append({"name": name, "width": a.size[0], "height": a.size[1], "fps": str(a.fps),
                        "loop_frames": a.num_frames})
        return out

    @app.post("/v1/jobs/render", status_code=202)
    async def submit_render(request: Request, avatar: str = Form(...), audio: UploadFile = File(...),
                            who: str = Depends(owner)) -> dict:
        """An avatar (by name) speaks an uploaded audio file: a job whose result is the MP4."""
        known_avatar(avatar)
        suffix = Path(audio.filename or "").suffix.lower()
        if suffix not in AUDIO_SUFFIXES:
            raise HTTPException(422, f"audio: a file ending in one of {sorted(AUDIO_SUFFIXES)} is allowed")
        check_cap(who)
        folder = new_upload_folder(service.uploads_dir)
        path = folder / f"audio{suffix}"
        try:
            await save_upload(audio, path, service.o.max_upload_mb)
            seconds = await asyncio.to_thread(audio_seconds, path)
            if seconds > service.o.max_audio_s:
                raise HTTPException(413, f"audio: {seconds:.0f} s; at most {service.o.max_audio_s:g} s is allowed")
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        job = service.store.submit(who, "render", {"avatar": avatar, "audio": os.path.relpath(path, service.o.data_dir),
                                                   "audio_s": round(seconds, 3)})
        service.runner.wake()
        return job_json(job)

    @app.post("/v1/jobs/broadcast", status_code=202)
    async def submit_broadcast(request: Request, script: UploadFile = File(...),
                               audio: list[UploadFile] = File(...), who: str = Depends(owner)) -> dict:
        """A broadcast script (YAML, as `lipstream broadcast` reads) and the audio files it names."""
        from lipstream.errors import LipStreamError
        from lipstream.script import load_script

        check_cap(who)
        names = [Path(a.filename or "").name for a in audio]
        if len(set(names)) != len(names) or any(Path(n).suffix.lower() not in AUDIO_SUFFIXES for n in names):
            raise HTTPException(422, f"audio: distinct files ending in one of {sorted(AUDIO_SUFFIXES)} are allowed")
        folder = new_upload_folder(service.uploads_dir)
        try:
            await save_upload(script, folder / "script.yaml", service.o.max_upload_mb)
            total = 0.0
            for upload, name in zip(audio, names):
                await save_upload(upload, folder / name, service.o.max_upload_mb)
                total += await asyncio.to_thread(audio_seconds, folder / name)
            try:
                program = load_script(folder / "script.yaml")
            except LipStreamError as e:
                raise HTTPException(422, f"script: {str(e).splitlines()[0]}") from None
            if program.avatars_dir is not None:
                raise HTTPException(422, "script: 'avatars:' is the server's (--avatars), not the script's")
            for k, scene in enumerate(program.scenes):
                if scene.audio.resolve().parent != folder.resolve() or not scene.audio.is_file():
                    raise HTTPException(422, f"script: scene {k + 1}'s audio must be one of the files sent: {names}")
                for shot in scene.shots:
                    known_avatar(shot.avatar)
            if total > service.o.max_audio_s:
                raise HTTPException(413, f"audio: {total:.0f} s in all; at most {service.o.max_audio_s:g} s is allowed")
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        job = service.store.submit(who, "broadcast", {"script": os.path.relpath(folder / "script.yaml",
                                                                                  service.o.data_dir),
                                                      "audio_s": round(total, 3)})
        service.runner.wake()
        return job_json(job)

    @app.post("/v1/jobs/compile", status_code=202)
    async def submit_compile(request: Request, name: str = Form(...), video: UploadFile = File(...),
                             who: str = Depends(owner)) -> dict:
        """A new avatar from an uploaded action loop (a video of the presenter): resident once compiled."""
        if not AVATAR_NAME.fullmatch(name):
            raise HTTPException(422, "name: letters, digits, '_', '.' and '-' are allowed")
        if name in service.avatars or (service.o.avatars_dir / name).exists():
            raise HTTPException(409, f"avatar {name!r} exists already")
        suffix = Path(video.filename or "").suffix.lower()
        if suffix not in VIDEO_SUFFIXES:
            raise HTTPException(422, f"video: a file ending in one of {sorted(VIDEO_SUFFIXES)} is allowed")
        check_cap(who)
        folder = new_upload_folder(service.uploads_dir)
        try:
            await save_upload(video, folder / f"{name}{suffix}", service.o.max_upload_mb)  # the file's stem names it
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        job = service.store.submit(who, "compile", {"name": name, "video": os.path.relpath(folder / f"{name}{suffix}",
                                                                                           service.o.data_dir)})
        service.runner.wake()
        return job_json(job)

    @app.post("/v1/sessions", status_code=201)
    async def open_session(request: Request, avatar: str, playout_delay_ms: float | None = None,
                           who: str = Depends(owner)) -> Response:
        """A live presenter over WebRTC: the body is the client's SDP offer (application/sdp), the
        answer comes back with the session's Location (DELETE it to end); speech goes to
        /v1/sessions/{id}/speech (a WebSocket) or comes as the offer's own audio track.
        `playout_delay_ms`: how far behind the speech this session plays (default: the server's);
        less is sooner, with more frames at risk of being late under load."""
        known_avatar(avatar)
        if playout_delay_ms is not None and not 50 <= playout_delay_ms <= 5000:
            raise HTTPException(422, f"playout_delay_ms: {playout_delay_ms:g}; 50 to 5000 is allowed")
        if sessions.count(who) >= service.o.sessions_per_key:
            raise HTTPException(429, f"this key has {service.o.sessions_per_key} live sessions open already",
                                headers={"Retry-After": str(RETRY_AFTER_S)})
        offer = (await request.body()).decode("utf-8", "replace")
        if "v=0" not in offer:
            raise HTTPException(422, "the body must be an SDP offer (Content-Type: application/sdp)")
        try:
            live, answer = await sessions.start(who, avatar, offer,
                                                None if playout_delay_ms is None else playout_delay_ms / 1000)
        except AdmissionError as e:
            raise HTTPException(503, str(e), headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as e:
            raise HTTPException(422, f"offer: {str(e).splitlines()[0]}") from None
        except RuntimeError as e:  # its WebRTC worker died under it: a new one takes the next session
            raise HTTPException(503, str(e), headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        return Response(answer, 201, media_type="application/sdp",
                        headers={"Location": f"/v1/sessions/{live.id}", "X-Session-Id": live.id})

    @app.get("/v1/sessions")
    def list_sessions(who: str = Depends(owner)) -> list[dict]:
        return [{"id": x.id, "avatar": x.avatar, "frames_played": x.session.stats.played,
                 "frames_late": x.session.stats.late} for x in sessions.open.values() if x.owner == who or not keys]

    @app.get("/v1/sessions/{sid}")
    def session_status(sid: str, who: str = Depends(owner)) -> dict:
        """One session's counters and, per speech frame kept, where its time went (ms by stage:
        audio arriving, features and scheduling, render, encode, slack before its deadline)."""
        live = sessions.open.get(sid)
        if live is None or (keys and live.owner != who):
            raise HTTPException(404, f"no live session {sid}")
        s = live.session
        return {"id": live.id, "avatar": live.avatar, "playout_delay_ms": round(s.o.playout_delay_s * 1000, 1),
                "video": "h264" if live.encoded else "vp8", "stats": dataclasses.asdict(s.stats),
                "timings_ms": s.timings_ms()}

    @app.delete("/v1/sessions/{sid}", status_code=204)
    async def close_session(sid: str, who: str = Depends(owner)) -> Response:
        live = sessions.open.get(sid)
        if live is None or (keys and live.owner != who):
            raise HTTPException(404, f"no live session {sid}")
        await sessions.close(sid)
        return Response(status_code=204)

    @app.websocket("/v1/sessions/{sid}/speech")
    async def speech(ws: WebSocket, sid: str, token: str | None = None) -> None:
        """Binary messages: PCM16 mono at `rate` (a first {"type": "start", "rate": 16000}; 16 kHz if
        none); {"type": "end"} ends an utterance, {"type": "interrupt"} cuts it off; speech events
        (started / finished / interrupted, at playout) come back as JSON."""
        who = key_owner(ws.headers.get("authorization", ""), token)
        live = sessions.open.get(sid)
        if who is None or live is None or (keys and live.owner != who):
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

    @app.get("/v1/jobs")
    def list_jobs(who: str = Depends(owner), limit: int = 100) -> list[dict]:
        return [job_json(j) for j in service.store.list(who if keys else None, limit=max(1, min(limit, 1000)))]

    @app.get("/v1/jobs/{job_id}")
    def get_job(job_id: str, who: str = Depends(owner)) -> dict:
        return job_json(own_job(job_id, who))

    @app.delete("/v1/jobs/{job_id}")
    def cancel_job(job_id: str, who: str = Depends(owner)) -> dict:
        own_job(job_id, who)
        return job_json(service.store.cancel(job_id))

    @app.get("/v1/jobs/{job_id}/events")
    async def job_events(job_id: str, who: str = Depends(owner_or_token)) -> StreamingResponse:
        """Server-sent events: the job as JSON each time it changes, until it is done, failed or cancelled."""
        own_job(job_id, who)

        async def events():
            seen, beat = None, time.monotonic()
            while True:
                version = service.store.version(job_id)
                if version != seen:
                    seen = version
                    job = service.store.get(job_id)
                    yield f"event: job\ndata: {json.dumps(job_json(job))}\n\n"
                    if job.status in TERMINAL:
                        return
                elif time.monotonic() - beat > 15:
                    beat = time.monotonic()
                    yield ": keep-alive\n\n"
                await asyncio.sleep(SSE_POLL_S)

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/v1/jobs/{job_id}/result")
    def job_result(job_id: str, who: str = Depends(owner_or_token)) -> Response:
        """The MP4 (HTTP Range works: players seek in it); a compile job's avatar, as /v1/avatars lists it."""
        job = own_job(job_id, who)
        if job.status != "done" or not job.result:
            raise HTTPException(409, f"job {job_id} is {job.status}: no result yet")
        if job.kind == "compile":
            return JSONResponse(next(a for a in avatars(who) if a["name"] == job.params["name"]))
        path = service.o.data_dir / job.result
        if not path.is_file():
            raise HTTPException(410, f"job {job_id}: its result is gone")
        return FileResponse(path, media_type="video/mp4", filename=f"{job_id}.mp4")

    return app

