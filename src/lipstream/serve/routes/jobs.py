"""/v1/jobs: render, broadcast and compile jobs submitted with their uploads, listed, cancelled,
followed as server-sent events, and their results. The runner (serve/jobs.py) does the work."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from pathlib import Path

from fastapi import APIRouter, Depends, File, Form, HTTPException, Request, UploadFile
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse

from lipstream.serve.auth import Caller, caller, caller_or_token
from lipstream.render.checks import SHOW_SUFFIXES, show_suffix
from lipstream.serve.options import AVATAR_NAME, RETRY_AFTER_S, UPLOAD_NAME
from lipstream.serve.interface import ServerHost
from lipstream.serve.routes.avatars import known_avatar
from lipstream.serve.state import get_service
from lipstream.serve.store.base import Job
from lipstream.yaml_input import MAX_YAML_BYTES
from lipstream.serve.uploads import (AUDIO_SUFFIXES, VIDEO_SUFFIXES, audio_seconds, new_upload_folder,
                                     save_upload)

TERMINAL = ("done", "failed", "cancelled")
SSE_POLL_S = 0.1
# what a render or broadcast job may be asked of its output, as `lipstream render` takes it (--fps, --crf,
# --x264-preset, --start-frame); what is not given is the server's choice, as a local render's is the machine's
OUTPUT_OPTIONS = ("fps", "crf", "x264_preset", "start_frame", "model")
MODELS = ("musetalk", "keysync")
TEXT_CHARACTERS_PER_S = 15  # a text scene's length as the --max-audio-s check estimates it (TTS speaks ~15/s)

router = APIRouter()


def job_json(job: Job) -> dict:
    """`options`: the output options the job was given (OUTPUT_OPTIONS), so a client sees they were taken;
    `runner` and `attempts`: which server (a fleet's replica) holds or held it, and how many claims it took
    (more than one: its runner stopped and another ran it again)."""
    out = {"id": job.id, "kind": job.kind, "status": job.status, "progress": round(job.progress, 4),
           "error": job.error, "created_at": job.created_at, "started_at": job.started_at,
           "finished_at": job.finished_at, "avatar": job.params.get("avatar"),
           "options": {k: job.params[k] for k in OUTPUT_OPTIONS if k in job.params},
           "runner": job.runner_id, "attempts": job.attempts}
    if job.status == "done":
        out["result"] = f"/v1/jobs/{job.id}/result"
    return out


def output_options(fps: str | None, crf: int | None, x264_preset: str | None,
                   start_frame: int | None = None, model: str | None = None) -> dict:
    """The output options given (422 naming the first that is not allowed), as the job's params keep them."""
    from lipstream.render.options import X264_PRESETS
    from lipstream.render.options import MAX_FPS
    from lipstream.media.rates import as_fps

    given: dict = {}
    if fps is not None:
        try:
            rate = as_fps(fps.strip())
        except ValueError:
            rate = None
        if rate is None or rate > MAX_FPS:
            raise HTTPException(422, f"fps {fps!r}: a frame rate above 0 and at most {MAX_FPS} is allowed, "
                                     "such as 25, 29.97 or 30000/1001")
        given["fps"] = str(rate)
    if crf is not None:
        if not 0 <= crf <= 51:
            raise HTTPException(422, f"crf {crf}: an x264 quality from 0 to 51 is allowed")
        given["crf"] = crf
    if x264_preset is not None:
        if x264_preset not in X264_PRESETS:
            raise HTTPException(422, f"x264_preset {x264_preset!r}: one of {', '.join(X264_PRESETS)} is allowed")
        given["x264_preset"] = x264_preset
    if start_frame is not None:
        if not 0 <= start_frame <= 10**9:
            raise HTTPException(422, f"start_frame {start_frame}: a loop frame from 0 is allowed")
        given["start_frame"] = start_frame
    if model is not None and model != "musetalk":  # musetalk: the default, not stored
        if model not in MODELS:
            raise HTTPException(422, f"model {model!r}: one of {', '.join(MODELS)} is allowed")
        given["model"] = model
    return given


def check_cap(service: ServerHost, who: Caller) -> None:
    if service.store.active(who.owner) >= service.o.jobs_per_key:
        raise HTTPException(429, f"this key has {service.o.jobs_per_key} jobs queued or running already",
                            headers={"Retry-After": str(RETRY_AFTER_S)})


def own_job(service: ServerHost, job_id: str, who: Caller) -> Job:
    job = service.store.get(job_id, who.scope)
    if job is None:
        raise HTTPException(404, f"no job {job_id}")
    return job


def submitted(service: ServerHost, who: Caller, kind: str, params: dict) -> dict:
    """The job stored, the runner woken."""
    job = service.store.submit(who.owner, kind, params)
    service.wake_runner()
    return job_json(job)


@router.post("/v1/jobs/render", status_code=202)
async def submit_render(request: Request, avatar: str = Form(...), audio: UploadFile = File(...),
                        fps: str | None = Form(None), crf: int | None = Form(None),
                        x264_preset: str | None = Form(None), start_frame: int | None = Form(None),
                        model: str | None = Form(None),
                        who: Caller = Depends(caller), service: ServerHost = Depends(get_service)) -> dict:
    """An avatar (by name) speaks an uploaded audio file: a job whose result is the MP4. `fps`, `crf`,
    `x264_preset`, `start_frame`, `model`: as `lipstream render` takes them (left out: the server chooses;
    MuseTalk)."""
    known_avatar(service, avatar)
    given = output_options(fps, crf, x264_preset, start_frame, model)
    suffix = Path(audio.filename or "").suffix.lower()
    if suffix not in AUDIO_SUFFIXES:
        raise HTTPException(422, f"audio: a file ending in one of {sorted(AUDIO_SUFFIXES)} is allowed")
    check_cap(service, who)
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
    return submitted(service, who, "render", {"avatar": avatar, "audio": os.path.relpath(path, service.o.data_dir),
                                              "audio_s": round(seconds, 3), **given})


@router.post("/v1/jobs/broadcast", status_code=202)
async def submit_broadcast(request: Request, script: UploadFile = File(...),
                           audio: list[UploadFile] | None = File(None), files: list[UploadFile] | None = File(None),
                           fps: str | None = Form(None), crf: int | None = Form(None),
                           x264_preset: str | None = Form(None), model: str | None = Form(None),
                           who: Caller = Depends(caller), service: ServerHost = Depends(get_service)) -> dict:
    """A broadcast script (YAML, as `lipstream broadcast` reads), the audio files it names (none when every
    scene is a `text:` one) and its show's `files` (logo, pip and cutaway sources, music, font, a Piper
    voice), each under the name the script gives it. `fps` (over the script's), `crf`, `x264_preset`, `model`:
    as `lipstream broadcast` takes them (left out: the server chooses; MuseTalk)."""
    from lipstream.errors import InputError, LipStreamError
    from lipstream.render.script import load_script

    audio, files = audio or [], files or []
    given = output_options(fps, crf, x264_preset, model=model)
    check_cap(service, who)
    names = [Path(a.filename or "").name for a in audio]
    if any(Path(n).suffix.lower() not in AUDIO_SUFFIXES for n in names):
        raise HTTPException(422, f"audio: distinct files ending in one of {sorted(AUDIO_SUFFIXES)} are allowed")
    extra = [f.filename or "" for f in files]
    for name in extra:
        if not UPLOAD_NAME.fullmatch(name) or show_suffix(name) is None:
            raise HTTPException(422, f"files: {name!r}: a file name (letters, digits, '_', '.', '-') ending in one "
                                     f"of {sorted(SHOW_SUFFIXES)} is allowed")
    every = names + extra
    if len(set(every)) != len(every) or "script.yaml" in every:
        raise HTTPException(422, "audio, files: distinct file names (and none named script.yaml) are allowed")
    folder = new_upload_folder(service.uploads_dir)
    try:
        await save_upload(script, folder / "script.yaml", min(service.o.max_upload_mb, MAX_YAML_BYTES / 2**20),
                          "script")
        seconds: dict[str, float] = {}
        for upload, name in zip(audio, names):
            await save_upload(upload, folder / name, service.o.max_upload_mb)
            seconds[name] = await asyncio.to_thread(audio_seconds, folder / name)
        for upload, name in zip(files, extra):
            await save_upload(upload, folder / name, service.o.max_upload_mb, "files")
        total = sum(seconds.values())
        try:
            # off the event loop: a script is bounded (yaml_input.py), but parsing even a bounded one is CPU
            program = await asyncio.to_thread(load_script, folder / "script.yaml")
        except InputError as e:  # named by the file sent, never by the server's folders
            sent = e.path.name if e.path != folder / "script.yaml" else Path(script.filename or "script.yaml").name
            raise HTTPException(422, f"script: {sent[:255]}: {e.problem.splitlines()[0]}") from None
        except LipStreamError as e:
            raise HTTPException(422, f"script: {str(e).splitlines()[0]}") from None
        if program.avatars_dir is not None:
            raise HTTPException(422, "script: 'avatars:' is the server's (--avatars), not the script's")
        for k, scene in enumerate(program.scenes):
            if scene.audio is not None and (scene.audio.resolve().parent != folder.resolve()
                                            or not scene.audio.is_file()):
                raise HTTPException(422, f"script: scene {k + 1}'s audio must be one of the files sent: {names}")
            for shot in scene.shots:
                known_avatar(service, shot.avatar)
        for path in program.show.files():
            if path.resolve().parent != folder.resolve() or not path.is_file():
                raise HTTPException(422, f"script: {path.name!r}: the show's files must be among the files sent: "
                                         f"{extra}")
        # text scenes are spoken on the server: their length is estimated from their words, so a script of
        # text alone cannot ask for hours of speech past --max-audio-s
        spoken = sum(len(s.text) for s in program.scenes if s.text is not None) / TEXT_CHARACTERS_PER_S
        if total + spoken > service.o.max_audio_s:
            what = f"{total:.0f} s in all" + (f" and ~{spoken:.0f} s of text scenes (at {TEXT_CHARACTERS_PER_S} "
                                              "characters a second)" if spoken else "")
            raise HTTPException(413, f"audio: {what}; at most {service.o.max_audio_s:g} s is allowed")
        await asyncio.to_thread(check_show_here, program, folder,
                                [None if s.audio is None else seconds.get(s.audio.name) for s in program.scenes],
                                await service.avatar_list())
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return submitted(service, who, "broadcast", {"script": os.path.relpath(folder / "script.yaml", service.o.data_dir),
                                                 "audio_s": round(total, 3), **given})


def check_show_here(program, folder: Path, durations: list[float | None],
                    avatars: list[dict]) -> None:
    """The show's checks that need the avatars' frame size, the scenes' lengths and the files (show/checks.py),
    as a 422 naming the uploaded file or the script (never the server's folders)."""
    from lipstream.errors import InputError
    from lipstream.show.checks import check_show, frame_size_of

    named = {shot.avatar for scene in program.scenes for shot in scene.shots}
    rows = [a for a in avatars if a["name"] in named]
    if not rows:
        return
    try:
        check_show(program, frame_size_of(rows), durations)
    except InputError as e:
        where = "" if e.path == folder / "script.yaml" else f"{e.path.name}: "
        raise HTTPException(422, f"script: {where}{e.problem}") from None


@router.post("/v1/jobs/compile", status_code=202)
async def submit_compile(request: Request, name: str = Form(...), video: UploadFile = File(...),
                         who: Caller = Depends(caller), service: ServerHost = Depends(get_service)) -> dict:
    """A new avatar from an uploaded action loop (a video of the presenter): resident once compiled."""
    if not AVATAR_NAME.fullmatch(name):
        raise HTTPException(422, "name: letters, digits, '_', '.' and '-' are allowed")
    if service.has_avatar(name) or (service.o.avatars_dir / name).exists():
        raise HTTPException(409, f"avatar {name!r} exists already")
    suffix = Path(video.filename or "").suffix.lower()
    if suffix not in VIDEO_SUFFIXES:
        raise HTTPException(422, f"video: a file ending in one of {sorted(VIDEO_SUFFIXES)} is allowed")
    check_cap(service, who)
    folder = new_upload_folder(service.uploads_dir)
    try:
        await save_upload(video, folder / f"{name}{suffix}", service.o.max_upload_mb)  # the file's stem names it
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return submitted(service, who, "compile", {"name": name, "video": os.path.relpath(folder / f"{name}{suffix}",
                                                                                      service.o.data_dir)})


@router.get("/v1/jobs")
def list_jobs(who: Caller = Depends(caller), limit: int = 100, service: ServerHost = Depends(get_service)) -> list[dict]:
    return [job_json(j) for j in service.store.list(who.scope, limit=max(1, min(limit, 1000)))]


@router.get("/v1/jobs/{job_id}")
def get_job(job_id: str, who: Caller = Depends(caller), service: ServerHost = Depends(get_service)) -> dict:
    return job_json(own_job(service, job_id, who))


@router.delete("/v1/jobs/{job_id}")
def cancel_job(job_id: str, who: Caller = Depends(caller), service: ServerHost = Depends(get_service)) -> dict:
    own_job(service, job_id, who)
    return job_json(service.store.cancel(job_id))


@router.get("/v1/jobs/{job_id}/events")
async def job_events(job_id: str, who: Caller = Depends(caller_or_token),
                     service: ServerHost = Depends(get_service)) -> StreamingResponse:
    """Server-sent events: the job as JSON each time it changes, until it is done, failed or cancelled."""
    own_job(service, job_id, who)
    store = service.store

    async def events():
        seen, beat = None, time.monotonic()
        while True:
            version = store.version(job_id)
            if version != seen:
                seen = version
                job = store.get(job_id)
                yield f"event: job\ndata: {json.dumps(job_json(job))}\n\n"
                if job.status in TERMINAL:
                    return
            elif time.monotonic() - beat > 15:
                beat = time.monotonic()
                yield ": keep-alive\n\n"
            await asyncio.sleep(SSE_POLL_S)

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.get("/v1/jobs/{job_id}/result")
async def job_result(job_id: str, who: Caller = Depends(caller_or_token),
                     service: ServerHost = Depends(get_service)) -> Response:
    """The MP4 (HTTP Range works: players seek in it); a compile job's avatar, as /v1/avatars lists it."""
    job = own_job(service, job_id, who)
    if job.status != "done" or not job.result:
        raise HTTPException(409, f"job {job_id} is {job.status}: no result yet")
    if job.kind == "compile":
        return JSONResponse(next(a for a in await service.avatar_list() if a["name"] == job.params["name"]))
    path = service.o.data_dir / job.result
    if not path.is_file():
        raise HTTPException(410, f"job {job_id}: its result is gone")
    return FileResponse(path, media_type="video/mp4", filename=f"{job_id}.mp4")
