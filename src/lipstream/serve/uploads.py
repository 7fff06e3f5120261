"""Uploads, bounded: refused by Content-Length before a byte is read (serve/bodies.py), cut off past
the limit while copied, audio measured once stored. Each upload gets a folder of its own under the data folder."""

from __future__ import annotations

import errno
import secrets
from pathlib import Path

from fastapi import HTTPException, UploadFile

from lipstream.faults import inject
from lipstream.render.checks import AUDIO_SUFFIXES, VIDEO_SUFFIXES

DISK_FULL = "the server's data folder is full: no room for the upload; try again later"

__all__ = ["AUDIO_SUFFIXES", "VIDEO_SUFFIXES", "audio_seconds", "new_upload_folder", "save_upload"]


def new_upload_folder(uploads_dir: Path) -> Path:
    folder = uploads_dir / secrets.token_hex(8)
    try:
        folder.mkdir(parents=True)
    except OSError as e:
        if disk_full(e):
            raise HTTPException(507, DISK_FULL) from None
        raise
    return folder


async def save_upload(upload: UploadFile, path: Path, max_mb: float, field: str = "audio") -> None:
    """Copy the upload to `path` (a temporary name first), 413 past the limit (naming the form's `field`),
    507 when the data folder's disk is full (the half-copied file removed)."""
    limit = int(max_mb * 2**20)
    part = path.with_name(path.name + ".part")
    size = 0
    try:
        with open(part, "wb") as f:
            inject("upload")
            while chunk := await upload.read(1 << 20):
                size += len(chunk)
                if size > limit:
                    raise HTTPException(413, f"{field}: over {max_mb:g} MB; at most that is allowed")
                f.write(chunk)
        part.rename(path)
    except OSError as e:
        part.unlink(missing_ok=True)
        if disk_full(e):  # 507 Insufficient Storage, one line without the server's paths
            raise HTTPException(507, DISK_FULL) from None
        raise


def disk_full(e: OSError) -> bool:
    return e.errno in (errno.ENOSPC, errno.EDQUOT)


def audio_seconds(path: Path) -> float:
    """Seconds of the first audio stream; 422 if there is none or it cannot be read."""
    import av

    try:
        with av.open(str(path)) as container:
            stream = next((s for s in container.streams if s.type == "audio"), None)
            if stream is None:
                raise HTTPException(422, "audio: the file has no audio stream")
            if stream.duration is not None and stream.time_base is not None:
                return float(stream.duration * stream.time_base)
            if container.duration is not None:
                return container.duration / 1_000_000
            return sum(f.samples for f in container.decode(stream)) / (stream.rate or 1)
    except av.FFmpegError as e:
        # FFmpeg's message ends in the file's path, a server's: its reason alone
        raise HTTPException(422, f"audio: not a readable audio file ({e.strerror or type(e).__name__})") from None
