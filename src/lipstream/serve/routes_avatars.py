"""/v1/avatars: the resident avatars, and the check by name that the job and session routes share
(an avatar is named, never a path)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException

from lipstream.serve.auth import Caller, caller
from lipstream.serve.options import AVATAR_NAME
from lipstream.serve.service import Service
from lipstream.serve.state import get_service

router = APIRouter()


def resident_avatars(service: Service) -> list[dict]:
    out = []
    for name, index in sorted(service.avatars.items()):
        a = service.live.engine.avatars[index]
        out.append({"name": name, "width": a.size[0], "height": a.size[1], "fps": str(a.fps),
                    "loop_frames": a.num_frames})
    return out


def known_avatar(service: Service, name: str) -> None:
    """422 for a name that is not one (a path, say), 404 for one that is not resident."""
    if not AVATAR_NAME.fullmatch(name):
        raise HTTPException(422, "avatar: a name of letters, digits, '_', '.' and '-' is allowed")
    if name not in service.avatars:
        raise HTTPException(404, f"avatar {name!r} is not resident (GET /v1/avatars lists them)")


@router.get("/v1/avatars")
def avatars(who: Caller = Depends(caller), service: Service = Depends(get_service)) -> list[dict]:
    return resident_avatars(service)
