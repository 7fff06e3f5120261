"""Every request body a client sends, bounded in one place (an ASGI middleware, before any route reads
it): a job's upload by --max-upload-mb, any other body (a session's SDP offer: a few KB) by
MAX_BODY_BYTES. A body is refused by its Content-Length before a byte of it is read, and one without
(chunked) is cut off with 413 once past its limit while read."""

from __future__ import annotations

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_BODY_BYTES = 64 * 1024  # a body that is not an upload: an SDP offer is 2-10 KB
FORM_SLACK_BYTES = 64 * 1024  # an upload's form: its fields and part headers beside the files


def is_upload(scope: Scope) -> bool:
    """A job's upload (a form of files): POST /v1/jobs/..."""
    return scope["method"] == "POST" and scope["path"].startswith("/v1/jobs")


class BodyLimits:
    """413 for a body over its route's limit, 411 for an upload without a Content-Length."""

    def __init__(self, app: ASGIApp, max_upload_mb: float):
        self.app, self.max_upload_mb = app, max_upload_mb

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        upload = is_upload(scope)
        limit = int(self.max_upload_mb * 2**20) + FORM_SLACK_BYTES if upload else MAX_BODY_BYTES
        what = f"upload over {self.max_upload_mb:g} MB" if upload else f"a body over {MAX_BODY_BYTES // 1024} KiB"
        length = dict(scope["headers"]).get(b"content-length")
        refused = None
        if length is None and upload:
            refused = JSONResponse({"detail": "uploads need a Content-Length"}, 411)
        elif length is not None and (not length.isdigit() or int(length) > limit):
            refused = JSONResponse({"detail": f"{what}; at most that is allowed"}, 413)
        if refused is not None:
            return await refused(scope, receive, send)
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # a chunked body (or one longer than it said): read no further
                    raise HTTPException(413, f"{what}; at most that is allowed")
            return message

        await self.app(scope, bounded, send)
