"""The one wire format between LipStream and its worker processes (encode workers, WebRTC workers), and
between a fleet's front and its replicas (serve/fleet/channel.py).

A message, either way: struct '<I' body length, then the body: a JSON header (utf-8, one line), b"\\n",
and a payload of raw bytes (frames, samples, packets). Each worker's module lists its own messages;
this module frames and reads them, and packs encoded packets. Standard library and numpy only: the
workers import it without torch.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
from fractions import Fraction
from typing import BinaryIO

from lipstream.media.session_encoder import EncodedPacket

LENGTH = struct.Struct("<I")

Message = tuple[dict, memoryview]


def frame_parts(header: dict, payload: bytes | memoryview = b"") -> list:
    """One framed message as the buffers to write (writelines, writev): the payload is not copied."""
    head = json.dumps(header, separators=(",", ":")).encode()
    payload = memoryview(payload).cast("B")  # a numpy array's buffer counts items, not bytes
    return [LENGTH.pack(len(head) + 1 + payload.nbytes), head, b"\n", payload]


def pack(header: dict, payload: bytes | memoryview = b"") -> bytes:
    """One framed message as bytes."""
    return b"".join(frame_parts(header, payload))


def write_all(fd: int, parts: list) -> None:
    """frame_parts() to a blocking file descriptor in one writev (the loop covers a short write anyway)."""
    parts = [p for p in parts if len(p)]
    while parts:
        n = os.writev(fd, parts)
        while parts and n >= len(parts[0]):
            n -= len(parts.pop(0))
        if n:
            parts[0] = memoryview(parts[0])[n:]


def _split(body: bytes) -> Message:
    split = body.index(b"\n")
    return json.loads(body[:split]), memoryview(body)[split + 1:]


def read_message(stream: BinaryIO) -> Message | None:
    """The next message's header and payload; None at a clean EOF (EOFError if a message is cut short)."""
    prefix = stream.read(LENGTH.size)
    if not prefix:
        return None
    if len(prefix) < LENGTH.size:
        raise EOFError("stream ended inside a message's length")
    (size,) = LENGTH.unpack(prefix)
    body = stream.read(size)
    if len(body) < size:
        raise EOFError(f"stream ended inside a message ({len(body)} of {size} bytes)")
    return _split(body)


async def read_message_async(reader: asyncio.StreamReader, max_size: int | None = None) -> Message | None:
    """read_message on an asyncio stream (the WebRTC workers and the server's side of them; a fleet's speech
    connections, from a peer not yet trusted: ValueError for a body over `max_size`, before reading it)."""
    try:
        prefix = await reader.readexactly(LENGTH.size)
        (size,) = LENGTH.unpack(prefix)
        if max_size is not None and size > max_size:
            raise ValueError(f"a message of {size} bytes (at most {max_size})")
        body = await reader.readexactly(size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise EOFError(f"stream ended inside a message ({len(e.partial)} bytes of it)") from None
    return _split(body)


def packets_message(packets: list[EncodedPacket]) -> tuple[list[list], bytes]:
    """Packets as a header's list of [kind "v" | "a", pts, dts, keyframe, size] and their data, joined."""
    return ([["v" if p.kind == "video" else "a", p.pts, p.dts, p.keyframe, len(p.data)] for p in packets],
            b"".join(p.data for p in packets))


def read_packets(listed: list[list], payload: memoryview, video_time_base: Fraction,
                 audio_time_base: Fraction) -> list[EncodedPacket]:
    """packets_message() read back."""
    out, at = [], 0
    for kind, pts, dts, key, size in listed:
        video = kind == "v"
        out.append(EncodedPacket("video" if video else "audio", bytes(payload[at:at + size]), pts, dts,
                                 video_time_base if video else audio_time_base, key))
        at += size
    return out


def one_line(e: BaseException) -> str:
    """An exception as one line for a reply: its type and the first line of its message."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
