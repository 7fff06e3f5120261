"""The render loop's GPU side: the engine's batches, crossfaded and painted on the device, copied into host buffers.

`BatchProducer` runs on a thread of its own and hands each batch to the writer (loop.py) through a bounded
queue and a ring of host buffers (`HostRing`); both sides note where their time goes in one record
(`LoopTimes`), which becomes the report's timings. On the way the producer captures the engine's other
buckets, when loop.py's rule says that repays the stop.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from lipstream.engine.blend import crossfade
from lipstream.engine.interface import FrameRequest
from lipstream.render.plan import Item, RenderPlan

PREFETCH_BATCHES = 2  # batches the engine is told are coming beyond the one asked for (FrameEngine.prefetch)
DONE = object()  # the producer's last item on the queue, after its last batch


class HostRing:
    """The host buffers the producer copies batches into and the writer reads them from, each allocated when
    first needed (pinned on CUDA, so the copy is an async DMA, and no fresh 100 MB allocation page-faults in
    every batch). A buffer goes back to the producer as soon as the writer has taken (copied or encoded) its
    frames."""

    def __init__(self, size: int, batch_size: int, pinned: bool):
        self.batch_size, self.pinned = batch_size, pinned
        self._buffers: list[torch.Tensor | None] = [None] * size
        self._free: queue.Queue = queue.Queue()
        for k in range(size):
            self._free.put(k)

    def take(self) -> int:
        """A free buffer's index: waits while the writer holds them all."""
        return self._free.get()

    def fill(self, k: int, batch: torch.Tensor, count: int) -> None:
        """Buffer k gets the batch's `count` frames (from a GPU asynchronously: an event recorded after this
        tells when they are there)."""
        if self._buffers[k] is None:  # each buffer when first needed: pinning ~100 MB is slow on a fresh VM's memory
            self._buffers[k] = torch.empty((self.batch_size, *batch.shape[1:]), dtype=batch.dtype,
                                           pin_memory=self.pinned)
        self._buffers[k][:count].copy_(batch, non_blocking=self.pinned)

    def frames(self, k: int) -> np.ndarray:
        return self._buffers[k].numpy()

    def give_back(self, k: int) -> None:
        self._free.put(k)

    def release_all(self) -> None:
        """Every index on the free queue again: a producer waiting for a buffer at shutdown goes on."""
        for k in range(len(self._buffers)):
            self._free.put(k)


@dataclass
class LoopTimes:
    """Where each side of the loop spends its time (stages, seconds) and when the first frames pass each
    point on their way to the first packet (marks, seconds from t0): which stage limits a run."""

    t0: float
    stages: dict[str, float] = field(default_factory=lambda: {
        "produce_launch_s": 0.0,  # CPU time to schedule a batch and queue its GPU work
        "produce_buffer_wait_s": 0.0,  # waiting for a free host buffer: the writer is behind
        "produce_queue_wait_s": 0.0,  # waiting for room in the queue: the writer is behind
        "consume_wait_s": 0.0,  # waiting for the next batch to be queued: the producer is behind
        "consume_gpu_wait_s": 0.0,  # waiting for that batch's GPU work and copy to finish
        "consume_write_s": 0.0})  # handing frames to the encoder(s)
    marks: dict[str, float] = field(default_factory=dict)

    def add(self, stage: str, seconds: float) -> None:
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds

    def mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter() - self.t0

    def mark_first(self, name: str) -> None:
        """`name` the first time only (the first batch's)."""
        self.marks.setdefault(name, time.perf_counter() - self.t0)

    def timings(self) -> dict[str, float]:
        """Stages then marks, rounded, for RenderReport.timings."""
        return {k: round(v, 4) for k, v in (self.stages | self.marks).items()}


class BatchTimer:
    """How long one batch's render took: on CUDA the GPU's own time between two events (read once both have
    happened), on a CPU the call's wall time."""

    def __init__(self, cuda: bool):
        self.frames = 0
        self._seconds: float | None = None
        if cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = self._end = None
            self._t = time.perf_counter()

    def stop(self, frames: int) -> BatchTimer:
        self.frames = frames
        if self._end is not None:
            self._end.record()
        else:
            self._seconds = time.perf_counter() - self._t
        return self

    def seconds(self) -> float | None:
        """None while the GPU has not reached the batch's end."""
        if self._seconds is None and self._end is not None and self._end.query():
            self._seconds = self._start.elapsed_time(self._end) / 1000
        return self._seconds


def first_bucket_rate(timers: list[BatchTimer]) -> float | None:
    """Frames per second of the first bucket's batches done so far (the first batch left out where there are
    others: it pays for first launches); None if none is done."""
    done = [(t.frames, s) for t in timers[1:] or timers if (s := t.seconds()) is not None and s > 0]
    return sum(f for f, _ in done) / sum(s for _, s in done) if done else None


def crossfaded(rendered: torch.Tensor, chunk: list[Item]) -> torch.Tensor:
    """The batch's frames with the previous scene's dissolved in where an item crossfades (those frames were
    rendered after the batch's own, in the items' order)."""
    out, extra = [], len(chunk)
    for j, item in enumerate(chunk):
        frame = rendered[j]
        if item.previous is not None:
            frame = crossfade(rendered[extra], frame, item.weight)
            extra += 1
        out.append(frame)
    return torch.stack(out)


class BatchProducer:
    """The loop's GPU side, on a thread of its own (`thread`): the engine's batches in the plan's order (the
    engine told of the next ones ahead), crossfaded, painted with the show's layers and copied into the ring.
    Each goes on `batches` as (buffer, frames, ready event), then DONE, or whatever was raised.

    The first batches take the first (captured) bucket. The other buckets are captured once the first packet
    is out (`first_packet_out`): a capture holds the GIL for a while, and the first segment's reply and mux
    need it. Until then the first bucket goes on (at most `early_batches`), so the GPU and the encoders keep
    busy; where the full bucket would not repay its capture (`capture_pays`), the first goes on to the end.
    """

    def __init__(self, render: RenderPlan, batches: queue.Queue, ring: HostRing, times: LoopTimes, *,
                 capture_in_loop: bool, skippable: bool, early_batches: int,
                 capture_pays: Callable[[int, float | None], bool]):
        self.render, self.engine, self.items = render, render.engine, render.items
        self.batches, self.ring, self.times = batches, ring, times
        self.cuda = self.engine.device.type == "cuda"
        self.batch_size = self.engine.buckets[-1]
        self.first = min(self.engine.buckets[0], self.batch_size)
        # after the first batch: what warm_up() may still capture
        self.to_capture = len(self.items) > self.first and capture_in_loop
        self.full = not capture_in_loop  # batches of the full size (after the first): once their bucket is captured
        self.skippable = skippable  # the first bucket captured before the loop: the others may be left uncaptured
        self.early_batches, self.capture_pays = early_batches, capture_pays  # the loop's settings (loop.py)
        self.early = 0  # batches rendered while the other buckets wait for their capture
        self.early_timers: list[BatchTimer] = []
        self.planned: collections.deque[tuple[int, int, list[FrameRequest]]] = collections.deque()  # hinted, in order
        self.next_start = 0
        self.first_packet_out = threading.Event()  # set by the writer's side once the first video packet is muxed
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.run, name="lipstream-render", daemon=True)

    def run(self) -> None:
        """The thread: every batch, then DONE; a failure goes on the queue instead, for the writer to raise."""
        try:
            while self.planned or self.next_start < len(self.items):
                if self.stopping.is_set():
                    return
                self.produce_batch()
            self.batches.put(DONE)
        except BaseException as e:  # hand any failure to the consumer, which raises it
            self.batches.put(e)

    def plan(self, size: int) -> None:
        """The next batch of `size` frames, told to the engine now (prefetch) and rendered in this order."""
        chunk = self.items[self.next_start:self.next_start + size]
        requests = [i.main for i in chunk] + [i.previous for i in chunk if i.previous is not None]
        self.engine.prefetch(requests)
        self.planned.append((self.next_start, self.next_start + len(chunk), requests))
        self.next_start += len(chunk)

    def produce_batch(self) -> None:
        """One batch: rendered, crossfaded, painted, copied into a free host buffer and queued."""
        t = time.perf_counter()
        while len(self.planned) < 1 + PREFETCH_BATCHES and self.next_start < len(self.items):
            self.plan(self.batch_size if self.full and self.next_start > 0 else self.first)
        start, end, requests = self.planned.popleft()
        chunk = self.items[start:end]
        timer = BatchTimer(self.cuda) if self.to_capture else None  # the first bucket's rate, for the decision
        rendered = self.engine.render(requests)
        if timer is not None:
            self.early_timers.append(timer.stop(len(chunk)))
        batch = rendered[:len(chunk)]
        if len(requests) > len(chunk):  # crossfades: dissolve the previous scene's frames in
            batch = crossfaded(rendered, chunk)
        if self.render.compositor is not None:
            batch = self.paint(batch, start, chunk)
        t1 = time.perf_counter()
        k = self.ring.take()
        t2 = time.perf_counter()
        self.ring.fill(k, batch, len(chunk))
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record()
        self.batches.put((k, len(chunk), ready))
        self.times.mark_first("first_batch_queued_s")
        self.times.add("produce_launch_s", t1 - t)
        self.times.add("produce_buffer_wait_s", t2 - t1)
        self.times.add("produce_queue_wait_s", time.perf_counter() - t2)
        self.early += self.to_capture
        if self.to_capture and (self.first_packet_out.is_set() or self.early >= self.early_batches):
            self.decide_capture(left=len(self.items) - end)

    def paint(self, batch: torch.Tensor, start: int, chunk: list[Item]) -> torch.Tensor:
        """The show's layers, on the device, before the copy out."""
        compositor, fps = self.render.compositor, self.render.fps
        ts = time.perf_counter()
        if batch.device.type != compositor.device.type:  # a server's live engine gives
            batch = batch.to(compositor.device)  # host frames: painted on the GPU all the same
        with torch.inference_mode():  # the engine's frames are inference tensors, painted in place
            batch = compositor.apply(
                batch, [(i.scene, float(i.local / fps), float((start + j) / fps)) for j, i in enumerate(chunk)])
        self.times.add("produce_show_s", time.perf_counter() - ts)
        return batch

    def decide_capture(self, left: int) -> None:
        """The other buckets captured now, while the first frames encode; or never, where the first bucket was
        captured before the loop and the full one would not repay the stop for the `left` frames."""
        self.to_capture = False
        marks = self.times.marks
        rate = first_bucket_rate(self.early_timers)
        if rate:
            marks["first_bucket_fps"] = round(rate, 1)
        if self.skippable and not self.capture_pays(left, rate):  # the first bucket to the end
            marks["warmup_later_skipped_frames"] = left
        else:
            t = time.perf_counter()  # the other buckets, while the first frames encode
            later = self.engine.warm_up()
            marks.update({f"warmup later {name} s": v for name, v in later.items()})
            marks["warmup_later_s"] = time.perf_counter() - t
            marks["warmup_later_at_s"] = t - self.render.t0
            self.full = True
        marks["early_batches"] = self.early

    def shut_down(self) -> None:
        """Stop the thread and wait for it, waking it wherever it waits: for a host buffer, or for room in the
        queue (the batches still queued are dropped)."""
        self.stopping.set()
        self.ring.release_all()
        while self.thread.is_alive():
            try:
                self.batches.get_nowait()
            except queue.Empty:
                self.thread.join(timeout=0.05)
