"""What a session's speech socket accepts, and the close codes it answers with: every message checked
before it reaches a session, so a malformed one is an error message and a close, never an exception.
The one check for a plain server and a fleet's front alike (both run routes/sessions.py's route).

Close codes (docs/serve.md, "Limits a client meets"):
  1003  a message of a type the socket does not take (a command other than start, end, interrupt, switch)
  1007  a malformed message: text that is not a JSON object, a bad field, PCM of an odd byte count
  1009  a message over its size limit
  4401  no key, or not a valid one
  4404  no such session for this key (an unknown session and another key's answer alike: a key cannot
        learn that another key's session exists)
  4410  the session has ended
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

# one binary message: 1 s of PCM16 at 192 kHz is 384,000 bytes (lipstream.client sends at most 1 s a message)
MAX_PCM_BYTES = 512 * 1024
MAX_COMMAND_CHARS = 4096  # one JSON command: {"type": "start", "rate": 16000} is 33
MIN_RATE, MAX_RATE = 8000, 192_000
DEFAULT_RATE = 16_000
COMMANDS = ("start", "end", "interrupt", "switch")
MAX_AVATAR_CHARS = 200

UNSUPPORTED, INVALID, TOO_BIG = 1003, 1007, 1009
NO_KEY, NO_SESSION, ENDED = 4401, 4404, 4410


class BadMessage(Exception):
    """A message the socket refuses: `code` closes it, `message` (sent as {"type": "error"}) says what is
    allowed; the close frame's reason is its first 120 bytes (the protocol's limit is 123)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message

    @property
    def reason(self) -> str:
        return close_reason(self.message)


def close_reason(message: str) -> str:
    """A close frame's reason: at most 123 bytes of UTF-8."""
    data = message.encode()
    return message if len(data) <= 123 else data[:120].decode(errors="ignore") + "..."


@dataclass(frozen=True)
class Audio:
    pcm16: bytes


@dataclass(frozen=True)
class Start:
    rate: int


@dataclass(frozen=True)
class Command:
    kind: str  # "end" or "interrupt"


@dataclass(frozen=True)
class Switch:
    avatar: str  # a camera cut to this resident avatar


def _shown(value: object) -> str:
    """A client's value in an error message, cut short (a rate of 1e300 is 354 digits as an int)."""
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    return text if len(text) <= 24 else text[:20] + "..."


def check_rate(value: object) -> int:
    """A start message's rate: a whole number of Hz from MIN_RATE to MAX_RATE (16000.0 is 16000)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value != int(value) or not MIN_RATE <= value <= MAX_RATE):
        raise BadMessage(INVALID, f"rate: {_shown(value)}; a whole number of Hz from {MIN_RATE} to {MAX_RATE} "
                                  "is allowed")
    return int(value)


def speech_message(message: dict) -> Audio | Start | Command | Switch:
    """One received ASGI websocket.receive message as what it asks for; BadMessage if it is not one the
    socket takes. Binary: PCM16 mono (an even byte count, at most MAX_PCM_BYTES); text: a JSON object
    {"type": "start", "rate": N} (rate optional: 16000), {"type": "end"}, {"type": "interrupt"} or
    {"type": "switch", "avatar": NAME}."""
    data = message.get("bytes")
    if data is not None:
        if len(data) > MAX_PCM_BYTES:
            raise BadMessage(TOO_BIG, f"a binary message of {len(data)} bytes; at most {MAX_PCM_BYTES} "
                                      "(PCM16 mono) is allowed")
        if len(data) % 2:
            raise BadMessage(INVALID, f"a binary message of {len(data)} bytes; PCM16 is 2 bytes a sample, "
                                      "an even count is allowed")
        return Audio(data)
    text = message.get("text") or ""
    if len(text) > MAX_COMMAND_CHARS:
        raise BadMessage(TOO_BIG, f"a text message of {len(text)} characters; at most {MAX_COMMAND_CHARS} "
                                  "is allowed")
    try:
        command = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        command = None
    allowed = ('{"type": "start", "rate": 16000}, {"type": "end"}, {"type": "interrupt"} or '
               '{"type": "switch", "avatar": "NAME"}')
    if not isinstance(command, dict):
        raise BadMessage(INVALID, f"a text message that is not a JSON object; {allowed} is allowed")
    kind = command.get("type")
    if kind not in COMMANDS:
        raise BadMessage(UNSUPPORTED, f"type: {_shown(kind)}; {allowed} is allowed")
    if kind == "start":
        return Start(check_rate(command.get("rate", DEFAULT_RATE)))
    if kind == "switch":
        avatar = command.get("avatar")
        if not isinstance(avatar, str) or not 0 < len(avatar) <= MAX_AVATAR_CHARS:
            raise BadMessage(INVALID, f"avatar: {_shown(avatar)}; a resident avatar's name is allowed")
        return Switch(avatar)
    return Command(kind)
