"""A client's SDP offer checked before a session is opened for it: what a WebRTC offer must have for the
server's peer connection to answer it, said in one line (no stack's internals), for a plain server and a
fleet's front alike (routes/sessions.py)."""

from __future__ import annotations

import re

_LINE = re.compile(r"[a-z]=[^\x00-\x08\x0a-\x1f\x7f]*")
_MEDIA = re.compile(r"m=(audio|video|application) \d+(/\d+)? [A-Za-z0-9/]+( \S+)+")


def offer_problem(offer: str) -> str | None:
    """What makes `offer` no WebRTC SDP offer, None if nothing: each line `x=...`, `v=0` first, an origin
    and a session name, audio or video media, ICE credentials and a DTLS fingerprint (for the session or
    its media)."""
    lines = [line for line in offer.replace("\r\n", "\n").split("\n") if line]
    if not lines or lines[0] != "v=0":
        return "it must begin with v=0"
    bad = next((i for i, line in enumerate(lines) if not _LINE.fullmatch(line)), None)
    if bad is not None:
        return f"line {bad + 1} is not type=value"
    if not any(line.startswith("o=") for line in lines) or not any(line.startswith("s=") for line in lines):
        return "it has no o= or no s= line"
    first = next((i for i, line in enumerate(lines) if line.startswith("m=")), None)
    if first is None:
        return "it has no m= line (audio or video)"
    session, media, m = lines[:first], [], None
    for line in lines[first:]:
        if line.startswith("m="):
            if not _MEDIA.fullmatch(line):
                return f"{line[:40]!r} is not an m= line"
            media.append(m := [line])
        else:
            m.append(line)
    if not any(s[0].startswith(("m=audio", "m=video")) for s in media):
        return "it has no audio or video"
    for attribute in ("a=ice-ufrag:", "a=ice-pwd:", "a=fingerprint:"):
        if not any(line.startswith(attribute) for line in session) and \
                not any(line.startswith(attribute) for s in media for line in s):
            return f"it has no {attribute[2:-1]}"
    return None
