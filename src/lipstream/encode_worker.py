"""An encode worker process: live sessions' SessionEncoders, off the engine process's GIL.

`python -m lipstream.encode_worker` reads messages on stdin and answers on stdout, strictly in arrival order.
Frames come through a shared-memory file per session (the parent writes a slot, the worker encodes from it);
packets come back in the replies. Imports only the stdlib, numpy, PyAV and session_encoder: no torch, so a
worker starts in a blink and costs ~60 MB, not a GPU context.

Wire format, both ways: struct '<I' body length, then the body: a JSON header (utf-8, one line), b"\\n", payload.

  parent -> worker                                              worker -> parent
  open {sid, width, height, fps: [num, den], audio, preset,     opened {sid, audio_frame_size}, payload =
        crf, gop_frames, matrix, path, slots}                          audio extradata (OpusHead / AAC config)
  frame {sid, pts, slot (-1: audio only), key}, payload =       packets {sid, pts, slot, packets: [[kind "v"|"a",
        float32 mono 48 kHz samples (maybe none)                         pts, dts, keyframe, size], ...]}, payload =
                                                                         the packets' data, concatenated
  restart {sid, video_pts, audio_pts}                           (no reply unless it fails)
  close {sid}                                                   closed {sid, packets: [...]} + data (the flush)
  ping {}                                                       pong {pid, torch: whether torch is imported}

A frame always answers 'packets' (with an 'error' field if its video or audio failed: the rest still goes out).
Anything else that fails (an unknown sid, an open or restart that raises) answers error {sid, request, message}
(plus pts and slot for a frame, so the parent can free the slot) and the worker goes on. EOF on stdin ends it.
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import struct
import sys
from fractions import Fraction
from typing import BinaryIO

import numpy as np

from lipstream.session_encoder import EncodedPacket, SessionEncoder

LENGTH = struct.Struct("<I")


def frame_parts(header: dict, payload: bytes | memoryview = b"") -> list:
    """One framed message as the buffers to write (writelines, writev): the payload is not copied."""
    head = json.dumps(header, separators=(",", ":")).encode()
    payload = memoryview(payload).cast("B")  # a numpy array's buffer counts items, not bytes
    return [LENGTH.pack(len(head) + 1 + payload.nbytes), head, b"\n", payload]


def pack(header: dict, payload: bytes = b"") -> bytes:
    """One framed message (the worker's replies; the parent writes its frames with writev instead)."""
    return b"".join(frame_parts(header, payload))


def read_message(stream: BinaryIO) -> tuple[dict, memoryview] | None:
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
    split = body.index(b"\n")
    return json.loads(body[:split]), memoryview(body)[split + 1:]


async def read_message_async(reader) -> tuple[dict, memoryview] | None:
    """read_message on an asyncio.StreamReader (serve/rtc.py and its workers)."""
    import asyncio

    try:
        prefix = await reader.readexactly(LENGTH.size)
        body = await reader.readexactly(LENGTH.unpack(prefix)[0])
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise EOFError(f"stream ended inside a message ({len(e.partial)} bytes of it)") from None
    split = body.index(b"\n")
    return json.loads(body[:split]), memoryview(body)[split + 1:]


def packets_header(packets: list[EncodedPacket]) -> tuple[list[list], bytes]:
    """Packets as the reply's list of [kind, pts, dts, keyframe, size] and their data, concatenated."""
    return ([["v" if p.kind == "video" else "a", p.pts, p.dts, p.keyframe, len(p.data)] for p in packets],
            b"".join(p.data for p in packets))


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


class _Session:
    """One session's encoder and its view of the parent's frame slots."""

    def __init__(self, h: dict):
        width, height, slots = h["width"], h["height"], h["slots"]
        self.encoder = SessionEncoder(width, height, Fraction(*h["fps"]), audio=h["audio"], preset=h["preset"],
                                      crf=h["crf"], gop_frames=h["gop_frames"], matrix=h["matrix"])
        size = slots * height * 3 // 2 * width
        fd = os.open(h["path"], os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.frames: np.ndarray | None = np.frombuffer(self._map, np.uint8).reshape(slots, height * 3 // 2, width)

    def release(self) -> None:
        self.frames = None  # the array holds the map's buffer: drop it first
        self._map.close()


class Worker:
    """The sessions of one worker process and the handling of each message."""

    def __init__(self, out: BinaryIO):
        self.out = out
        self.sessions: dict[int, _Session] = {}

    def reply(self, header: dict, payload: bytes = b"") -> None:
        self.out.write(pack(header, payload))
        self.out.flush()

    def session(self, sid: int) -> _Session:
        if sid not in self.sessions:
            raise LookupError(f"unknown session {sid}")
        return self.sessions[sid]

    def handle(self, h: dict, payload: memoryview) -> None:
        kind, sid = h.get("type"), h.get("sid", -1)
        try:
            if kind == "frame":
                self.frame(self.session(sid), h, payload)
            elif kind == "open":
                self.open(sid, h)
            elif kind == "restart":
                self.session(sid).encoder.restart(h["video_pts"], h["audio_pts"])
            elif kind == "close":
                self.close(sid)
            elif kind == "ping":
                self.reply({"type": "pong", "pid": os.getpid(), "torch": "torch" in sys.modules})
            else:
                raise ValueError(f"unknown message type {kind!r}")
        except Exception as e:  # noqa: BLE001 - every failure goes back to the parent, the worker goes on
            error = {"type": "error", "sid": sid, "request": kind, "message": one_line(e)}
            if kind == "frame":
                error.update(pts=h.get("pts"), slot=h.get("slot", -1))
            self.reply(error)

    def open(self, sid: int, h: dict) -> None:
        if sid in self.sessions:
            raise ValueError(f"session {sid} is already open")
        session = self.sessions[sid] = _Session(h)
        enc = session.encoder
        self.reply({"type": "opened", "sid": sid, "audio_frame_size": getattr(enc, "audio_frame_size", None)},
                   enc.audio_extradata or b"")

    def frame(self, session: _Session, h: dict, payload: memoryview) -> None:
        """Video, then audio; one 'packets' reply whatever happens, with 'error' if either part failed (the
        other part's packets still go out: a bad audio slice must not cost the frame)."""
        enc, slot, out, errors = session.encoder, h["slot"], [], []
        if h.get("key"):
            enc.request_keyframe()
        if slot >= 0:
            try:
                out += enc.encode(session.frames[slot], h["pts"])
            except Exception as e:  # noqa: BLE001
                errors.append(f"video: {one_line(e)}")
        if len(payload):
            try:
                out += enc.encode_audio(np.frombuffer(payload, np.float32))
            except Exception as e:  # noqa: BLE001
                errors.append(f"audio: {one_line(e)}")
        listed, data = packets_header(out)
        reply = {"type": "packets", "sid": h["sid"], "pts": h["pts"], "slot": slot, "packets": listed}
        if errors:
            reply["error"] = f"frame {h['pts']}: " + "; ".join(errors)
        self.reply(reply, data)

    def close(self, sid: int) -> None:
        session = self.sessions.pop(sid)
        try:
            listed, data = packets_header(session.encoder.flush())
        finally:
            session.release()
        self.reply({"type": "closed", "sid": sid, "packets": listed}, data)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it ends us with EOF
    out = os.fdopen(os.dup(1), "wb")  # the replies get a private copy of stdout ...
    os.dup2(2, 1)  # ... and fd 1 becomes stderr, so a stray print (or a C library's) cannot break the stream
    sys.stdout = sys.stderr
    worker = Worker(out)
    stdin = sys.stdin.buffer
    try:
        while (message := read_message(stdin)) is not None:
            worker.handle(*message)
    except BrokenPipeError:  # the parent is gone
        pass
    for session in worker.sessions.values():
        session.release()


if __name__ == "__main__":
    main()
