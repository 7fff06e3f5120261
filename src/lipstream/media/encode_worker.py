"""An encode worker process: live sessions' SessionEncoders, off the engine process's GIL.

`python -m lipstream.media.encode_worker` reads messages on stdin and answers on stdout, strictly in arrival
order (media/encode_pool.py is the parent's side). Frames come through a shared-memory file per session (the
parent writes a slot, the worker encodes from it); packets come back in the replies. Imports only the stdlib,
numpy, PyAV and lipstream.media: no torch, so a worker starts in a blink and costs ~60 MB, not a GPU context.

Messages are framed as lipstream.media.wire frames them (length, JSON header line, payload):

  parent -> worker                                              worker -> parent
  open {sid, width, height, fps: [num, den], audio,            opened {sid, audio_frame_size}, payload =
        x264_preset, crf, gop_frames, matrix, path, slots}             audio extradata (OpusHead / AAC config)
  frame {sid, pts, slot (-1: audio only), key}, payload =       packets {sid, pts, slot, packets: [[kind "v"|"a",
        float32 mono 48 kHz samples (maybe none)                         pts, dts, keyframe, size], ...]}, payload =
                                                                         the packets' data, concatenated
  restart {sid, video_pts, audio_pts}                           (no reply unless it fails)
  close {sid}                                                   closed {sid, packets: [...]} + data (the flush)
  ping {}                                                       pong {pid, torch: whether torch is imported}

MP4Writer's segment encoders (media/segment_pool.py) use the same workers with three more messages:

  map {sid, arena, path, slots, width, height}                  mapped {sid, arena}
  segment {sid, arena, slots: [...], start, width, height,      segment {sid, packets: [[pts, dts, keyframe,
           fps, options, colorspace, threads}                            size], ...]} + data: encode_segment's
  unmap {arena}                                                 (no reply unless it fails)

A frame always answers 'packets' (with an 'error' field if its video or audio failed: the rest still goes out).
Anything else that fails (an unknown sid, an open or restart that raises) answers error {sid, request, message}
(plus pts and slot for a frame, so the parent can free the slot) and the worker goes on. EOF on stdin ends it.
"""

from __future__ import annotations

import mmap
import os
import signal
import sys
from fractions import Fraction
from typing import BinaryIO

import numpy as np

from lipstream.heap import give_back_heap
from lipstream.media.segments import encode_segment
from lipstream.media.session_encoder import SessionEncoder
from lipstream.media.wire import one_line, pack, packets_message, read_message


class FrameSlots:
    """The worker's view of a shared-memory file of I420 frame slots that the parent writes."""

    def __init__(self, path: str, slots: int, width: int, height: int):
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, slots * height * 3 // 2 * width)
        finally:
            os.close(fd)
        self.frames: np.ndarray | None = np.frombuffer(self._map, np.uint8).reshape(slots, height * 3 // 2, width)

    def release(self) -> None:
        self.frames = None  # the array holds the map's buffer: drop it first
        self._map.close()


class WorkerSession(FrameSlots):
    """One session's encoder, and its view of the frame slots the parent writes."""

    def __init__(self, h: dict):
        super().__init__(h["path"], h["slots"], h["width"], h["height"])
        self.encoder = SessionEncoder(h["width"], h["height"], Fraction(*h["fps"]), audio=h["audio"],
                                      x264_preset=h["x264_preset"], crf=h["crf"], gop_frames=h["gop_frames"],
                                      matrix=h["matrix"])


class EncodeWorker:
    """The sessions of one encode worker process, and the handling of each message."""

    def __init__(self, out: BinaryIO):
        self.out = out
        self.sessions: dict[int, WorkerSession] = {}
        self.arenas: dict[int, FrameSlots] = {}  # MP4Writers' frame arenas, by the parent's arena id

    def reply(self, header: dict, payload: bytes = b"") -> None:
        self.out.write(pack(header, payload))
        self.out.flush()

    def session(self, sid: int) -> WorkerSession:
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
            elif kind == "segment":
                self.segment(sid, h)
            elif kind == "map":
                if h["arena"] in self.arenas:
                    raise ValueError(f"arena {h['arena']} is already mapped")
                self.arenas[h["arena"]] = FrameSlots(h["path"], h["slots"], h["width"], h["height"])
                self.reply({"type": "mapped", "sid": sid, "arena": h["arena"]})
            elif kind == "unmap":
                self.arenas.pop(h["arena"]).release()
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
        session = self.sessions[sid] = WorkerSession(h)
        enc = session.encoder
        self.reply({"type": "opened", "sid": sid, "audio_frame_size": getattr(enc, "audio_frame_size", None)},
                   enc.audio_extradata or b"")

    def frame(self, session: WorkerSession, h: dict, payload: memoryview) -> None:
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
        listed, data = packets_message(out)
        reply = {"type": "packets", "sid": h["sid"], "pts": h["pts"], "slot": slot, "packets": listed}
        if errors:
            reply["error"] = f"frame {h['pts']}: " + "; ".join(errors)
        self.reply(reply, data)

    def segment(self, sid: int, h: dict) -> None:
        """One closed-GOP segment of MP4Writer's, from frame slots of a mapped arena."""
        if h["arena"] not in self.arenas:
            raise LookupError(f"arena {h['arena']} is not mapped")
        frames = self.arenas[h["arena"]].frames
        encoded = encode_segment([frames[slot] for slot in h["slots"]], h["start"], h["width"], h["height"],
                                 Fraction(*h["fps"]), h["options"], h["colorspace"], h["threads"])
        listed = [[pts, dts, key, len(data)] for data, pts, dts, key in encoded]
        self.reply({"type": "segment", "sid": sid, "packets": listed}, b"".join(data for data, *_ in encoded))
        del frames, encoded
        give_back_heap(every_s=0.0)  # x264's frame buffers, freed into its threads' arenas

    def close(self, sid: int) -> None:
        session = self.sessions.pop(sid)
        try:
            listed, data = packets_message(session.encoder.flush())
        finally:
            session.release()
        self.reply({"type": "closed", "sid": sid, "packets": listed}, data)
        give_back_heap(every_s=0.0)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it ends us with EOF
    out = os.fdopen(os.dup(1), "wb")  # the replies get a private copy of stdout ...
    os.dup2(2, 1)  # ... and fd 1 becomes stderr, so a stray print (or a C library's) cannot break the stream
    sys.stdout = sys.stderr
    worker = EncodeWorker(out)
    stdin = sys.stdin.buffer
    try:
        while (message := read_message(stdin)) is not None:
            worker.handle(*message)
    except BrokenPipeError:  # the parent is gone
        pass
    for mapped in [*worker.sessions.values(), *worker.arenas.values()]:
        mapped.release()


if __name__ == "__main__":
    main()
