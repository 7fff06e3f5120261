"""/v1/avatars: the resident avatars, and the check by name that the job and session routes share
(an avatar is named, never a path)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException

from lipstream.serve.auth import Caller, caller
from lipstream.serve.options import AVATAR_NAME
from lipstream.serve.interface import ServerHost
from lipstream.serve.state import get_service

router = APIRouter()


def known_avatar(service: ServerHost, name: str) -> None:
    """422 for a name that is not one (a path, say), 404 for one that is not resident."""
    if not AVATAR_NAME.fullmatch(name):
        raise HTTPException(422, "avatar: a name of letters, digits, '_', '.' and '-' is allowed")
    if not service.has_avatar(name):
        raise HTTPException(404, f"avatar {name!r} is not resident (GET /v1/avatars lists them)")


@router.get("/v1/avatars")
async def avatars(who: Caller = Depends(caller), service: ServerHost = Depends(get_service)) -> list[dict]:
    return await service.avatar_list()
