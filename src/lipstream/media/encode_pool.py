"""Live sessions' encoders in worker processes: frames through shared memory in, packets back, off our GIL.

Encoding in the engine process costs ~0.8 ms of GIL a frame (PyAV objects, bytes); at hundreds of frames a
second the encoder threads, dropping and retaking the GIL all the time, starve the core thread and the asyncio
loop (a GIL convoy). Here each session's SessionEncoder lives in a worker process (encode_worker.py lists its
messages, wire.py frames them); a submit costs one copy into a shared-memory slot, one small header and one
write, and one reader thread per worker (blocked in reads, off the GIL) hands the packets back. Torch-free,
like the worker.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import secrets
import subprocess
import tempfile
import threading
import time
from fractions import Fraction
from typing import Callable

import numpy as np

from lipstream.media.processes import start_worker
from lipstream.media.session_encoder import EncodedPacket
from lipstream.media.wire import frame_parts, one_line, read_message, read_packets, write_all
from lipstream.media.rates import AUDIO_RATE

log = logging.getLogger(__name__)

SHM_PREFIX = "lipstream-encode-"  # slot files: lipstream-encode-<pid>-<sid>-<random>, unlinked once mapped
SLOT_WAIT_S = 5.0  # a submit waits this long for a free frame slot
OPEN_WAIT_S = 20.0  # open waits this long for 'opened' (a fresh worker imports PyAV first)
CLOSE_WAIT_S = 5.0  # close waits this long for the final packets
EXIT_WAIT_S = 5.0  # pool.close waits this long for the workers to end, then kills them

OnPackets = Callable[[int, list[EncodedPacket]], None]
OnError = Callable[[int, str], None]


def slot_dir() -> str:
    """/dev/shm (memory, not disk) where there is one, else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _slot_file(sid: int, size: int) -> tuple[str, mmap.mmap]:
    """A new file of `size` bytes, mapped; its pages are reserved now (a full /dev/shm fails here with ENOSPC,
    not later with SIGBUS on a write), falling back to the temp dir."""
    for folder in dict.fromkeys([slot_dir(), tempfile.gettempdir()]):
        path = os.path.join(folder, f"{SHM_PREFIX}{os.getpid()}-{sid}-{secrets.token_hex(4)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _reserve(fd, size)
            return path, mmap.mmap(fd, size)
        except OSError as e:
            os.unlink(path)
            if folder == tempfile.gettempdir():
                raise
            log.warning("encode session %d: no room for %d bytes of frame slots in %s (%s); using %s",
                        sid, size, folder, e.strerror, tempfile.gettempdir())
        finally:
            os.close(fd)
    raise AssertionError("unreachable")


def _reserve(fd: int, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)  # a file system that cannot reserve: the pages come with the first writes


class EncodeWorkerProcess:
    """The parent's handle of one encode worker: its stdin (one writer at a time), its reader thread and the
    sessions it holds."""

    def __init__(self, index: int):
        self.index = index
        self.proc = start_worker("lipstream.media.encode_worker")
        self.pid = self.proc.pid
        self.name = f"encode worker {index} (pid {self.pid})"
        self.sessions: dict[int, PooledEncoder] = {}
        self.failure: str | None = None  # set once the process is gone
        self._fd = self.proc.stdin.fileno()
        self._write = threading.Lock()
        self._stdin_closed = False
        self._closing = False
        self.reader = threading.Thread(target=self._read, name=f"lipstream-encode-reader-{index}", daemon=True)
        self.reader.start()

    def send(self, header: dict, payload: bytes | memoryview = b"") -> None:
        """One message; RuntimeError (one line) if the worker is gone."""
        parts = frame_parts(header, payload)
        with self._write:
            if self.failure is not None or self._stdin_closed:
                raise RuntimeError(self.failure or f"{self.name}: the encode pool is closed")
            try:
                write_all(self._fd, parts)
            except OSError as e:
                self.proc.kill()  # a message may be cut short: the stream is lost, the reader reports the death
                raise RuntimeError(f"{self.name}: {e.strerror or e}") from None

    def end_input(self) -> None:
        """EOF to the worker: it finishes what it was sent, then exits."""
        self._closing = True
        with self._write:
            if not self._stdin_closed:
                self._stdin_closed = True
                try:
                    self.proc.stdin.close()
                except OSError:
                    pass

    def _dispatch(self, header: dict, payload: memoryview) -> None:
        """A reply to its session. Its own function: the session it looked up is not held (with everything its
        callbacks reach) while the reader waits for the next reply, which may never come."""
        session = self.sessions.get(header.get("sid"))
        if session is not None:
            session._reply(header, payload)
        else:  # frames a session submitted as it closed
            log.debug("%s: a %r reply for no open session (%s)", self.name, header.get("type"),
                      header.get("message", header.get("sid")))

    def _read(self) -> None:
        stream, why = self.proc.stdout, None
        try:
            while (message := read_message(stream)) is not None:
                self._dispatch(*message)
        except Exception as e:  # noqa: BLE001 - a broken stream ends the worker like a crash
            why = one_line(e)
            self.proc.kill()
        try:
            code = self.proc.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:  # it closed stdout but lives on: end it
            self.proc.kill()
            code = self.proc.wait()
        stream.close()
        if why:
            self.failure = f"{self.name} sent a broken reply ({why})"
        else:
            self.failure = f"{self.name}: the encode pool closed" if self._closing else \
                f"{self.name} exited with code {code}"
        sessions, self.sessions = list(self.sessions.values()), {}
        for session in sessions:
            session._fail(self.failure, report=not self._closing)


class PooledEncoder:
    """One session's SessionEncoder, inside a worker process of the pool. Frames are encoded in submit order.

    Every submit gets one on_packets(pts, packets) call, later, on the worker's reader thread, in submit order
    (packets = [] if the frame failed: on_error says why, just before), until the worker dies: then on_error
    once, and the frames still in flight are lost. Callbacks must be quick and must not block on the pool (a
    submit waiting for a slot, a close): they run on the thread that frees the slots. Frames submitted before
    a restart still come back, before any later one.
    """

    def __init__(self, sid: int, width: int, height: int, fps: Fraction, slots: int, mapped: mmap.mmap,
                 on_packets: OnPackets, on_error: OnError | None):
        self.sid = sid
        self.width, self.height, self.fps = width, height, fps
        self._shape, self._slots = (height * 3 // 2, width), slots
        self._map = mapped
        self._frames: np.ndarray | None = np.frombuffer(mapped, np.uint8).reshape(slots, *self._shape)
        self._free: queue.SimpleQueue[int | None] = queue.SimpleQueue()  # None: the worker is gone
        for slot in range(slots):
            self._free.put(slot)
        self._on_packets, self._on_error = on_packets, on_error
        self._video_tb, self._audio_tb = 1 / fps, Fraction(1, AUDIO_RATE)
        self._state = "opening"  # opening, open, closing, closed
        self._failure: str | None = None
        self._opened, self._closed = threading.Event(), threading.Event()
        self._open_error: str | None = None
        self._final: list[EncodedPacket] = []
        self._audio_extradata: bytes | None = None
        self.audio_frame_size: int | None = None  # 960 (Opus), 1024 (AAC), None without audio
        self._worker: EncodeWorkerProcess | None = None

    # --- the caller's side ----------------------------------------------------------------------

    @property
    def audio_extradata(self) -> bytes | None:
        """OpusHead or the AAC AudioSpecificConfig, as SessionEncoder.audio_extradata."""
        return self._audio_extradata

    @property
    def worker_pid(self) -> int:
        return self._worker.pid

    @property
    def failure(self) -> str | None:
        """Why the session is over (its worker died, or the pool closed); None while it works."""
        return self._failure

    def submit(self, pts: int, i420: np.ndarray | None, audio: np.ndarray | None, key: bool = False) -> None:
        """Queue a frame: i420 uint8 [H*3/2, W] is copied at once (the caller may reuse it); None = audio only
        (a frame the engine skipped: its audio still goes in, so the audio stream stays continuous).
        key = make this frame an IDR. Blocks while every slot is in flight (RuntimeError after SLOT_WAIT_S)."""
        if self._state != "open" or self._failure is not None:
            raise RuntimeError(self._failure or f"encode session {self.sid}: {self._state}")
        slot = -1
        if i420 is not None:
            if i420.shape != self._shape or i420.dtype != np.uint8:
                raise ValueError(f"encode session {self.sid}: expected uint8 I420 of shape {self._shape}, "
                                 f"got {i420.dtype} {i420.shape}")
            slot = self._take_slot()
            frames = self._frames
            if frames is None:
                raise RuntimeError(self._failure or f"encode session {self.sid}: {self._state}")
            np.copyto(frames[slot], i420)
        payload = b""
        if audio is not None and np.size(audio):
            payload = memoryview(np.ascontiguousarray(audio, np.float32).reshape(-1)).cast("B")
        try:
            self._worker.send({"type": "frame", "sid": self.sid, "pts": int(pts), "slot": slot, "key": bool(key)},
                              payload)
        except RuntimeError as e:
            if slot >= 0:
                self._free.put(slot)
            raise RuntimeError(f"encode session {self.sid}: {e}") from None

    def restart(self, video_pts: int, audio_pts: int) -> None:
        """SessionEncoder.restart in the worker, after the frames submitted so far (no reply: a failure goes to
        on_error). The next frame is an IDR with any pts >= video_pts; audio pts go on from audio_pts."""
        if self._state != "open" or self._failure is not None:
            raise RuntimeError(self._failure or f"encode session {self.sid}: {self._state}")
        try:
            self._worker.send({"type": "restart", "sid": self.sid, "video_pts": int(video_pts),
                               "audio_pts": int(audio_pts)})
        except RuntimeError as e:
            raise RuntimeError(f"encode session {self.sid}: {e}") from None

    def close(self) -> list[EncodedPacket]:
        """Flush: the last packets (the audio tail), after every earlier on_packets call. Never raises for the
        worker's sake: if it is gone or takes over CLOSE_WAIT_S, on_error says so and this returns []."""
        if self._state in ("closing", "closed"):
            return []
        self._state = "closing"
        try:
            if self._failure is None:
                self._worker.send({"type": "close", "sid": self.sid})
                if not self._closed.wait(CLOSE_WAIT_S):
                    self._report(f"encode session {self.sid}: no final packets from {self._worker.name} "
                                 f"in {CLOSE_WAIT_S:g} s")
        except RuntimeError:  # the worker died meanwhile: its reader reports it
            pass
        finally:
            self._state = "closed"
            self._worker.sessions.pop(self.sid, None)
            self._release()
        return self._final

    # --- the reader thread's side ---------------------------------------------------------------

    def _take_slot(self) -> int:
        try:
            slot = self._free.get(timeout=SLOT_WAIT_S)
        except queue.Empty:
            raise RuntimeError(f"encode session {self.sid}: no free frame slot in {SLOT_WAIT_S:g} s "
                               f"(all {self._slots} in flight)") from None
        if slot is None:
            self._free.put(None)  # for the next waiter
            raise RuntimeError(self._failure)
        return slot

    def _packets(self, listed: list, payload: memoryview) -> list[EncodedPacket]:
        return read_packets(listed, payload, self._video_tb, self._audio_tb)

    def _reply(self, h: dict, payload: memoryview) -> None:
        kind = h["type"]
        if kind == "packets":
            if h["slot"] >= 0:
                self._free.put(h["slot"])
            if "error" in h:
                self._report(f"encode session {self.sid}: {h['error']}")
            self._call(self._on_packets, h["pts"], self._packets(h["packets"], payload))
        elif kind == "opened":
            self.audio_frame_size = h["audio_frame_size"]
            self._audio_extradata = bytes(payload) or None
            self._opened.set()
        elif kind == "closed":
            self._final = self._packets(h["packets"], payload)
            self._closed.set()
        elif kind == "error":
            request, why = h.get("request"), f"encode session {self.sid}: {h['message']}"
            if request == "open":
                self._open_error = why
                self._opened.set()
            elif request == "close":
                self._report(why)
                self._closed.set()
            elif request == "frame":
                if h.get("slot", -1) >= 0:
                    self._free.put(h["slot"])
                self._report(why)
                self._call(self._on_packets, h["pts"], [])
            else:
                self._report(why)

    def _fail(self, why: str, report: bool) -> None:
        """The worker is gone: wake every waiter, say so once (not while the pool closes), drop the slots."""
        if self._failure is not None:
            return
        self._failure = f"encode session {self.sid}: {why}"
        self._free.put(None)
        self._opened.set()
        self._closed.set()
        if report and self._state in ("open", "closing"):
            self._report(self._failure)
        self._release()

    def _report(self, why: str) -> None:
        if self._on_error is None:
            log.warning("%s", why)
        else:
            self._call(self._on_error, self.sid, why)

    def _call(self, callback: Callable, *args) -> None:
        try:
            callback(*args)
        except Exception:  # noqa: BLE001 - the reader thread serves every session of its worker: it goes on
            log.exception("encode session %d: %s raised", self.sid, getattr(callback, "__name__", "a callback"))

    def _release(self) -> None:
        self._frames = None  # the array holds the map's buffer: drop it first
        try:
            self._map.close()
        except BufferError:  # a submit still holds a view: the map goes with it
            pass


class EncodePool:
    """Worker processes that encode live sessions' frames off the engine's GIL."""

    def __init__(self, processes: int):
        if processes < 1:
            raise ValueError(f"processes: {processes}; at least 1")
        self._lock = threading.Lock()
        self._workers = [EncodeWorkerProcess(i) for i in range(processes)]
        self._retired: list[EncodeWorkerProcess] = []  # dead workers replaced by fresh ones, joined at close
        self._next_sid = 0
        self._closed = False

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self._workers]

    def open(self, width: int, height: int, fps: Fraction, *, audio: str = "opus", x264_preset: str = "ultrafast",
             crf: int = 23, gop_frames: int | None = None, matrix: str = "bt601", slots: int = 8,
             on_packets: OnPackets, on_error: OnError | None = None) -> PooledEncoder:
        """A session on the least busy worker (SessionEncoder's settings; `slots` frames may be in flight).
        on_error(sid, message): a frame failed (the session goes on) or the worker died (the session is over)."""
        if width <= 0 or height <= 0 or width % 2 or height % 2:
            raise ValueError(f"yuv420p needs even positive dimensions, got {width}x{height}")
        if audio not in ("opus", "aac", "none"):
            raise ValueError(f"audio must be 'opus', 'aac' or 'none', got {audio!r}")
        if matrix not in ("bt601", "bt709"):
            raise ValueError(f"matrix must be 'bt601' or 'bt709', got {matrix!r}")
        if slots < 1:
            raise ValueError(f"slots: {slots}; at least 1")
        fps = Fraction(fps)
        with self._lock:
            if self._closed:
                raise RuntimeError("the encode pool is closed")
            sid, self._next_sid = self._next_sid, self._next_sid + 1
        path, mapped = _slot_file(sid, slots * height * 3 // 2 * width)
        session = PooledEncoder(sid, width, height, fps, slots, mapped, on_packets, on_error)
        try:
            with self._lock:
                worker = session._worker = self._least_busy()
                worker.sessions[sid] = session
            worker.send({"type": "open", "sid": sid, "width": width, "height": height,
                         "fps": [fps.numerator, fps.denominator], "audio": audio, "x264_preset": x264_preset, "crf": int(crf),
                         "gop_frames": gop_frames, "matrix": matrix, "path": path, "slots": slots})
            if not session._opened.wait(OPEN_WAIT_S):
                raise RuntimeError(f"encode session {sid}: {worker.name} did not open it in {OPEN_WAIT_S:g} s")
            if session._open_error or session._failure:
                raise RuntimeError(session._open_error or session._failure)
        except BaseException:
            session._state = "closed"
            if session._worker is not None:
                session._worker.sessions.pop(sid, None)
            session._release()
            raise
        finally:
            os.unlink(path)  # both processes hold the map: nothing stays on disk, whoever dies
        session._state = "open"
        return session

    def _least_busy(self) -> EncodeWorkerProcess:
        """The worker with the fewest sessions; a dead one is replaced first (its sessions have failed, or
        will as soon as its reader sees its end: a worker killed a moment ago has exited, not said so yet)."""
        for i, w in enumerate(self._workers):
            if w.failure is not None or w.proc.poll() is not None:
                log.warning("%s; starting another", w.failure or f"{w.name} exited with code {w.proc.returncode}")
                self._retired.append(w)
                self._workers[i] = EncodeWorkerProcess(i)
        return min(self._workers, key=lambda w: len(w.sessions))

    def close(self) -> None:
        """End every worker (EOF, then kill after EXIT_WAIT_S) and join the readers; open sessions fail
        quietly (close them first to get their last packets). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            workers = self._workers + self._retired
        for w in workers:
            w.end_input()
        deadline = time.monotonic() + EXIT_WAIT_S
        for w in workers:
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
        for w in workers:
            w.reader.join()

    def __enter__(self) -> EncodePool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
