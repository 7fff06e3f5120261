"""MP4Writer's parallel x264 segment encoders as worker processes: frames through shared memory, off our GIL.

In one process the segment encoders' Python (wrapping frames, packets, bytes) shares a GIL with the render's
producer and muxer; on 16 cores a one-shot render kept only 4 of them busy, waiting on its encoders for
most of its loop. Here each encoder is an encode worker process (encode_worker.py, the
live sessions' kind): a writer's frames go into one shared-memory arena that every worker maps, a segment
is a list of its slots, and the packets come back on the worker's reader thread. Pickling 3 MB frames
through pipes instead ran 3x slower than threads (docs/BENCHMARKS.md): only slot numbers travel here.
Torch-free, like the workers.

An arena is a gigabyte at 1080p, and on a virtual machine the first touch of fresh memory is what costs
(0.6-1.2 s a GiB on this project's machines, against 0.06 s for a copy into touched pages): so its pages
are faulted in on a thread as soon as it is made (`SegmentPool.prepare`, which the CLI calls while the
networks load), and a closed writer's arena stays mapped for the pool's next writer of that frame size.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import mmap
import os
import threading
from concurrent.futures import Future, InvalidStateError
from fractions import Fraction

import numpy as np

from lipstream.media.encode_pool import EncodeWorkerProcess, SHM_PREFIX, slot_dir
from lipstream.media.segments import Encoded, encode_segment
from lipstream.media.wire import one_line

log = logging.getLogger(__name__)

ROOM = 1.25  # an arena is made only where its file system has this much more room than it needs
IDLE_ARENAS = 1  # closed writers' arenas kept mapped for the next writer (each ~1 GiB at 1080p)
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault pages in writable, their contents untouched
_POOLS: dict[int, SegmentPool] = {}
_POOLS_LOCK = threading.Lock()


class _Job:
    """One segment in flight: the reader thread's side (EncodeWorkerProcess calls _reply and _fail). A worker
    that dies under it (killed, crashed) does not fail it: the pool encodes it again (SegmentPool._retry)."""

    def __init__(self, worker: EncodeWorkerProcess, jid: int, pool: SegmentPool | None = None,
                 arena: Arena | None = None, header: dict | None = None, future: Future | None = None):
        self.worker, self.jid = worker, jid
        self.pool, self.arena, self.header = pool, arena, header
        self.future: Future[list[Encoded]] = Future() if future is None else future

    def _reply(self, h: dict, payload: memoryview) -> None:
        self.worker.sessions.pop(self.jid, None)
        if self.future.done():  # cancelled by an aborted write: its packets go nowhere (the worker is sound)
            return
        if h["type"] == "segment":
            out, at = [], 0
            for pts, dts, key, size in h["packets"]:
                out.append((bytes(payload[at:at + size]), pts, dts, key))
                at += size
            self.future.set_result(out)
        else:
            self.future.set_exception(RuntimeError(f"x264 segment encoder: {h.get('message', h['type'])}"))

    def _fail(self, why: str, report: bool) -> None:
        if self.future.done():
            return
        if self.pool is None or not report:  # the pool is closing: nothing waits for it
            self.future.set_exception(RuntimeError(why))
        else:
            self.pool._retry(self, why)


class _Mapping(_Job):
    """An arena's map request to one worker: once every worker has mapped it, its file can go."""

    def __init__(self, worker: EncodeWorkerProcess, jid: int, arena: Arena):
        super().__init__(worker, jid)
        self.arena = arena

    def _reply(self, h: dict, payload: memoryview) -> None:
        self.worker.sessions.pop(self.jid, None)
        if h["type"] != "mapped":
            log.warning("%s could not map a frame arena: %s", self.worker.name, h.get("message", h["type"]))
            self.arena._unmapped(self.worker)
        self.arena._mapped_one()

    def _fail(self, why: str, report: bool) -> None:
        if report:
            log.warning("%s before it mapped a render's frames: its segments go elsewhere", why)
        self.arena._unmapped(self.worker)  # its segments go to the others (or are encoded here)
        self.arena._mapped_one()


class Arena:
    """A writer's frame slots, [slots, H*3/2, W] uint8, in a shared-memory file that every worker maps.

    The file is unlinked as soon as all workers have mapped it (or the arena closes): nothing stays on disk
    whoever dies. Its pages come with the first writes; `SegmentPool.arena` checked the room for them."""

    def __init__(self, pool: SegmentPool, aid: int, width: int, height: int, slots: int):
        self.pool, self.aid, self.slots = pool, aid, slots
        self.width, self.height = width, height
        self.failure: str | None = None
        size = slots * height * 3 // 2 * width
        self.path = os.path.join(slot_dir(), f"{SHM_PREFIX}{os.getpid()}-arena{aid}-{os.urandom(4).hex()}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.frames: np.ndarray | None = np.frombuffer(self._map, np.uint8).reshape(slots, height * 3 // 2, width)
        self._waiting = len(pool.workers)
        self.workers: list[EncodeWorkerProcess] = list(pool.workers)  # those that map it (sent the map)
        self._lock = threading.Lock()
        self.prefaulted = threading.Event()
        threading.Thread(target=self._prefault, name="lipstream-arena-prefault", daemon=True).start()

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.width, self.height, self.slots

    def _prefault(self) -> None:
        """Every page faulted in now, on this thread (the kernel's work, outside the GIL), not one by one in
        the writer's copies. MADV_POPULATE_WRITE leaves the contents alone, so a writer may already be
        writing; where the kernel lacks it, a read of one byte a page faults them in (a shared-memory file
        has no zero page to map)."""
        try:
            frames = self.frames
            if frames is None:
                return
            flat = frames.reshape(-1)
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            if libc.madvise(flat.ctypes.data, flat.size, MADV_POPULATE_WRITE) != 0:
                int(flat[::mmap.PAGESIZE].sum(dtype=np.uint64))
        except (OSError, AttributeError, ValueError):
            pass  # the writer's copies fault them in, as before
        finally:
            self.prefaulted.set()

    def _mapped_one(self) -> None:
        with self._lock:
            self._waiting -= 1
            if self._waiting == 0:
                self._unlink()

    def _unmapped(self, worker: EncodeWorkerProcess) -> None:
        with self._lock:
            self.workers = [w for w in self.workers if w is not worker]

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def release(self) -> None:
        """The writer is done with it: kept mapped for the pool's next writer (see IDLE_ARENAS), or closed."""
        self.pool._keep(self)

    def close(self) -> None:
        """Unmapped here and (after the segments already sent) in every worker. Idempotent."""
        if self.frames is None:
            return
        self.prefaulted.wait()  # its thread reads the map
        self._unlink()
        for worker in self.workers:  # those that map it (a fresh worker in a dead one's place does not)
            try:
                worker.send({"type": "unmap", "arena": self.aid})
            except RuntimeError:
                pass  # a dead worker holds no map
        self.frames = None  # the array holds the map's buffer: drop it first
        try:
            self._map.close()
        except BufferError:  # a view is still out (an aborted write): the map goes with it
            pass


class SegmentPool:
    """`processes` encode workers that MP4Writers hand closed-GOP segments to; each runs one at a time."""

    def __init__(self, processes: int):
        if processes < 1:
            raise ValueError(f"processes: {processes}; at least 1")
        self.workers = [EncodeWorkerProcess(i) for i in range(processes)]
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._idle: list[Arena] = []  # closed writers' arenas, mapped in every worker, for the next writer
        self._preparing: threading.Thread | None = None  # prepare()'s, which the next arena() waits for

    def prepare(self, width: int, height: int, slots: int) -> None:
        """Make the arena a writer of this frame size will ask for, on a thread, its pages faulted in there:
        called before the frames exist (the CLI, while its networks load), the first frames find it ready."""
        def make() -> None:
            arena = self.arena(width, height, slots)
            if arena is not None:
                arena.release()

        self._preparing = threading.Thread(target=make, name="lipstream-arena", daemon=True)
        self._preparing.start()

    def arena(self, width: int, height: int, slots: int) -> Arena | None:
        """Frame slots every worker can read; None where the shared-memory file system lacks the room.

        An idle arena of this shape is reused (its pages are in already, or coming: a prepare() under way is
        waited for, not made twice); else a new one is made."""
        preparing = self._preparing
        if preparing is not None and preparing is not threading.current_thread():
            preparing.join()
        with self._lock:
            self._replace_dead()
            for arena in self._idle:
                if arena.shape == (width, height, slots) and arena.failure is None:
                    self._idle.remove(arena)
                    return arena
        size = slots * height * 3 // 2 * width
        stat = os.statvfs(slot_dir())
        if stat.f_bavail * stat.f_frsize < size * ROOM:
            log.warning("no room for %d MiB of encoder frames in %s: the segment encoders run as threads",
                        size >> 20, slot_dir())
            return None
        with self._lock:
            self._replace_dead()
            arena = Arena(self, next(self._ids), width, height, slots)
            for worker in self.workers:
                jid = next(self._ids)
                worker.sessions[jid] = _Mapping(worker, jid, arena)
                try:
                    worker.send({"type": "map", "sid": jid, "arena": arena.aid, "path": arena.path, "slots": slots,
                                 "width": width, "height": height})
                except RuntimeError:  # it died: it takes no segment of this arena
                    worker.sessions.pop(jid, None)
                    arena._unmapped(worker)
                    arena._mapped_one()
        return arena

    def submit(self, arena: Arena, slots: list[int], start: int, width: int, height: int, fps: Fraction,
               options: dict[str, str], colorspace: int, threads: int) -> Future[list[Encoded]]:
        """encode_segment of arena.frames[slots] on the worker with the fewest segments in flight (of those
        that map the arena); encoded again elsewhere if that worker dies before it answers."""
        if arena.failure is not None:
            raise RuntimeError(arena.failure)
        header = {"type": "segment", "sid": -1, "arena": arena.aid, "slots": slots, "start": start,
                  "width": width, "height": height, "fps": [fps.numerator, fps.denominator],
                  "options": options, "colorspace": colorspace, "threads": threads}
        workers = arena.workers
        if not workers:  # every worker that mapped it has died: here, as a retry would
            job = _Job(self.workers[0], -1, self, arena, header)
            self._retry(job, "no segment encoder process holds this render's frames")
            return job.future
        with self._lock:
            worker = min(workers, key=lambda w: (w.failure is not None, len(w.sessions)))
            jid = next(self._ids)
            job = worker.sessions[jid] = _Job(worker, jid, self, arena, header)
        try:
            worker.send({**header, "sid": jid})
        except RuntimeError as e:  # it died a moment ago (its reader has not said so yet)
            worker.sessions.pop(jid, None)
            self._retry(job, str(e))
        return job.future

    def _retry(self, job: _Job, why: str) -> None:
        """A segment whose worker died (killed, crashed, out of memory): sent again to another live worker that
        maps its arena, else encoded in this process on a thread. The writer waits on the same future; the
        frames are still in the arena (their slots come back only with the result)."""
        arena, start = job.arena, job.header["start"]
        arena._unmapped(job.worker)
        with self._lock:
            live = [w for w in arena.workers if w.failure is None and w.proc.poll() is None]
            worker = min(live, key=lambda w: len(w.sessions)) if live else None
            if worker is not None:
                jid = next(self._ids)
                again = worker.sessions[jid] = _Job(worker, jid, self, arena, {**job.header, "sid": jid},
                                                    job.future)
        if worker is not None:
            log.warning("segment from frame %d: %s; sent again to %s", start, why, worker.name)
            try:
                worker.send(again.header)
                return
            except RuntimeError as e:  # that one is going too: its reader fails the job again, or we do
                if worker.sessions.pop(jid, None) is None:
                    return
                why = str(e)
        log.warning("segment from frame %d: %s; encoded in this process", start, why)
        threading.Thread(target=self._encode_here, args=(job, why), name="lipstream-segment-retry",
                         daemon=True).start()

    @staticmethod
    def _encode_here(job: _Job, why: str) -> None:
        h, frames = job.header, job.arena.frames
        try:
            if frames is None:  # the write was aborted meanwhile: nothing waits for it
                raise RuntimeError(why)
            encoded = encode_segment([frames[slot] for slot in h["slots"]], h["start"], h["width"], h["height"],
                                     Fraction(*h["fps"]), h["options"], h["colorspace"], h["threads"])
        except Exception as e:  # noqa: BLE001 - the writer gets it, in one line
            outcome: list[Encoded] | BaseException = RuntimeError(f"x264 segment encoder: {one_line(e)}")
        else:
            outcome = encoded
        try:
            if isinstance(outcome, BaseException):
                job.future.set_exception(outcome)
            else:
                job.future.set_result(outcome)
        except InvalidStateError:  # cancelled (an aborted write), or a worker's answer came first
            pass

    def _keep(self, arena: Arena) -> None:
        """A released arena: kept for the next writer if it is sound, else closed. The last released is the
        one kept (a prepare()'s is what the coming writer asks for); an older idle arena beyond IDLE_ARENAS
        is closed (it was the new one, and a prepare() for another frame size than the last render's was
        thrown away at once)."""
        if arena.failure is not None or arena.frames is None:
            arena.close()
            return
        with self._lock:
            self._idle.append(arena)
            gone = self._idle[:len(self._idle) - IDLE_ARENAS]
            del self._idle[:len(gone)]
        for old in gone:
            old.close()

    def _replace_dead(self) -> None:
        """A dead worker's segments have failed; a new arena gets a fresh worker in its place (the idle
        arenas, which the new worker has not mapped, are closed). Called under the lock."""
        for i, w in enumerate(self.workers):
            if w.failure is not None or w.proc.poll() is not None:  # exited, its reader may not have said so yet
                log.warning("%s; starting another", w.failure or f"{w.name} exited with code {w.proc.returncode}")
                self.workers[i] = EncodeWorkerProcess(i)
                idle, self._idle = self._idle, []
                for arena in idle:
                    arena.close()

    def cpu_s(self) -> float:
        """The workers' CPU time so far (user + system), where /proc says it: are the cores full?"""
        total = 0.0
        for w in self.workers:
            try:
                with open(f"/proc/{w.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            except (OSError, ValueError, IndexError):
                pass
        return total

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for arena in idle:
            arena.close()
        for w in self.workers:
            w.end_input()
        for w in self.workers:
            w.reader.join()


def segment_pool(processes: int) -> SegmentPool:
    """The process's pool of that many segment encoders, started at the first call and reused after.

    Starting it costs a few milliseconds here; each worker imports PyAV in its own process, so a caller
    that starts it early (the CLI, before its networks load) finds the workers ready at the first segment."""
    with _POOLS_LOCK:
        if processes not in _POOLS:
            _POOLS[processes] = SegmentPool(processes)
        return _POOLS[processes]
