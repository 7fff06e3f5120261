"""The HTTP app of `lipstream serve` (FastAPI), assembled: the routers (avatars, jobs, sessions),
the request log and counter, health, readiness, metrics, and the web page at / (static files, no
build step).

Every /v1 route takes a bearer key when the server has keys (serve/auth.py); the routers reach the
server behind them through app.state (serve/state.py): a ServerHost (serve/interface.py), this
process's Service or a fleet's front. Every body is bounded here, before any route reads it: uploads by
--max-upload-mb, anything else (a session's offer) by 64 KiB (serve/bodies.py).
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from lipstream.serve.routes import avatars, jobs, sessions
from lipstream.serve.auth import use_keys
from lipstream.serve.bodies import BodyLimits
from lipstream.serve.interface import ServerHost
from lipstream.serve.options import RETRY_AFTER_S
from lipstream.serve.private_paths import server_folders, without_server_paths
from lipstream.serve.state import get_service, use_service

log = logging.getLogger("lipstream.serve")
STATIC = Path(__file__).with_name("static")
PAGE_CSP = "default-src 'self'"  # the page loads nothing from elsewhere (its WebSocket is same-origin too)
ROUTERS = (avatars.router, jobs.router, sessions.router)

probes = APIRouter()  # the page and what operators poll: no key needed


def create_app(service: ServerHost) -> FastAPI:
    app = FastAPI(title="LipStream", version="0.1", lifespan=lifespan,
                  description="MuseTalk lip-sync as a service: render jobs and live presenter sessions.")
    use_service(app, service)
    use_keys(app, service.o.api_keys)
    app.add_middleware(BodyLimits, max_upload_mb=service.o.max_upload_mb)
    app.middleware("http")(count)  # added last: outermost, it logs and counts what BodyLimits refuses too
    app.exception_handler(HTTPException)(no_server_paths)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.include_router(probes)
    for router in ROUTERS:
        app.include_router(router)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI):
    service = app.state.service
    await service.start_serving()
    yield
    await service.stop_serving()  # SIGTERM: the running job requeued, sessions closed


async def no_server_paths(request: Request, exc: HTTPException) -> Response:
    """Every refusal's `detail` without the server's folders (serve/private_paths.py), whichever route
    raised it."""
    if isinstance(exc.detail, str):
        exc.detail = without_server_paths(exc.detail, server_folders(get_service(request).o))
    return await http_exception_handler(request, exc)


async def count(request: Request, call_next):
    """Every request logged (its path, never its query: a ?token= stays out) and counted by route."""
    service = get_service(request)
    t = time.perf_counter()
    response = await call_next(request)
    if request.url.path == "/" or request.url.path.startswith("/static/"):
        response.headers["Cache-Control"] = "no-cache"  # revalidated: an upgraded server's page shows at once
    route = request.scope.get("route")
    service.count_request(getattr(route, "path", "other"), response.status_code)
    log.info(json.dumps({"event": "request", "method": request.method, "path": request.url.path,
                         "status": response.status_code, "ms": round(1000 * (time.perf_counter() - t), 1)}))
    return response


@probes.get("/", include_in_schema=False)
def page() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers={"Content-Security-Policy": PAGE_CSP})


@probes.get("/healthz")
def healthz() -> dict:
    return {"status": "ok"}


@probes.get("/readyz")
async def readyz(service: ServerHost = Depends(get_service)) -> Response:
    failure = service.failure()
    if failure is not None:  # the engine stopped: a balancer takes this server out, an orchestrator restarts it
        return JSONResponse({"status": "failed", "error": failure}, 503)
    if not service.is_ready():
        return JSONResponse({"status": "starting"}, 503, headers={"Retry-After": str(RETRY_AFTER_S)})
    return JSONResponse({"status": "ready", "avatars": len(await service.avatar_list())})


@probes.get("/metrics")
async def metrics(service: ServerHost = Depends(get_service)) -> Response:
    return Response(await service.metrics_text(), media_type=CONTENT_TYPE_LATEST)
