"""The render loop: a planned render's frames through the engine into the MP4 writer, nothing on disk between.

A producer thread runs the engine batch by batch (GPU work, the show's layers painted on the device) into a
ring of pinned host buffers; the caller's thread hands the frames to the writer, which encodes and muxes.
They meet in a bounded queue, so memory stays flat and both sides stay busy. The loop also decides when the
engine's other buckets are captured (after the first packet, and only where they repay the stop) and runs
at a short GIL switch interval. program.py makes the plan (`prepare`; its data: plan.py); the benchmark's
ablations hand `write` other writers.
"""

from __future__ import annotations

import collections
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from tqdm import tqdm

from lipstream.engine.blend import crossfade
from lipstream.engine.interface import FrameRequest
from lipstream.errors import LipStreamError
from lipstream.render.interrupts import DeferredInterrupt
from lipstream.media.mp4 import MP4Writer
from lipstream.render.options import RenderOptions
from lipstream.render.plan import RenderPlan
from lipstream.media.rates import AUDIO_RATE

QUEUE_BATCHES = 4  # batches of frames in flight between the GPU and the encoder
PREFETCH_BATCHES = 2  # batches the engine is told are coming beyond the one asked for (FrameEngine.prefetch)
EARLY_BATCHES = 8  # at most this many first-bucket batches before the other buckets are captured anyway
# Whether the render loop captures the other buckets or stays on the first: their capture stops the producer
# while the encoders starve (bucket 32 on the H200 with the packages: 0.80-0.92 s), and the full bucket is
# only ~1.35x bucket 8 per frame there (412 against ~560 frames/s; the encoders take at most ~430), ~1.15x
# bucket 16 (485 on the H100), the GPU's first bucket since 2026-12-05 (EngineOptions.for_device). So it is
# captured only when the first bucket would need long enough for what is left, at its measured rate, for the
# share saved to repay the stop: left / rate * (1 - 1 / FULL_BUCKET_SPEEDUP) > LATER_CAPTURE_COST_S. The
# speedup is taken above the packages' 1.35 (the uncompiled modules gain more from larger batches), so a
# render that might gain captures (docs/BENCHMARKS.md, 2026-12-05). The 775-frame monologue on the packages:
# 1.9 s of first-bucket GPU time, 0.6 s to save: not captured; on the uncompiled networks' first bucket, it is.
FULL_BUCKET_SPEEDUP = 1.5
LATER_CAPTURE_COST_S = 0.85
# The render loop's GIL switch interval. Its producer's GPU launches (the show's layers: ~150 PyTorch ops a
# batch) each drop the GIL and take it back, while the writer, the encoders' reply readers and the video
# decoders run Python beside it; CPython makes a holder give the GIL up only after this long (5 ms by
# default), so each op can wait that long (the convoy: lipstream.bench.gil_convoy; ServeOptions uses 0.5 ms).
LOOP_SWITCH_INTERVAL_S = 0.0005

class VideoWriter(Protocol):
    """What `write` hands frames to (MP4Writer; the benchmark's ablations bring others)."""

    frames: int  # written so far
    first_packet_at: float | None  # perf_counter() when the first video packet was muxed
    first_submit_at: float | None  # perf_counter() when the first frames went to an encoder
    disk_bytes_written: int  # temporary files on the way (MP4Writer: none)

    def __enter__(self) -> VideoWriter: ...

    def __exit__(self, *exc) -> None: ...

    def write(self, planes: np.ndarray) -> None:
        """One [H*3/2, W] uint8 I420 frame, copied (or encoded) before it returns."""

    def poll(self) -> None:
        """Mux whatever is ready (called while waiting for frames)."""


@dataclass
class RenderReport:
    output: Path
    frames: int
    fps: Fraction
    duration_s: float
    wall_s: float
    first_frame_s: float  # until the first encoded video packet was written
    timings: dict[str, float] = field(default_factory=dict)
    disk_bytes_written: int = 0  # temporary files on the way (none: only a replaced writer writes any)

    @property
    def render_fps(self) -> float:
        return self.frames / self.wall_s if self.wall_s else 0.0


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


def later_capture_pays(left: int, rate: float | None) -> bool:
    """Whether capturing the full bucket now repays its stop (see FULL_BUCKET_SPEEDUP): unknown rate, it does."""
    if rate is None:
        return True
    return left / rate * (1 - 1 / FULL_BUCKET_SPEEDUP) > LATER_CAPTURE_COST_S


def write(render: RenderPlan, output: Path, options: RenderOptions, *,
          writer: Callable[..., VideoWriter] = MP4Writer,
          on_progress: Callable[[int, int], None] | None = None) -> RenderReport:
    """Run the plan into `output` through `writer` (an MP4Writer with the options' x264 settings)."""
    engine, items, t0, fps = render.engine, render.items, render.t0, render.fps
    width, height = render.size
    report = RenderReport(output, len(items), render.fps, float(Fraction(render.audio48.size, AUDIO_RATE)), 0.0,
                          0.0, dict(render.timings))
    report.timings["encoders"] = options.encoders
    batch_size = engine.buckets[-1]
    frames: queue.Queue = queue.Queue(maxsize=QUEUE_BATCHES)
    stop = threading.Event()
    done = object()
    # Host frames land in a ring of batch buffers, each allocated when first needed (pinned on CUDA, so
    # the copy is an async DMA, and no fresh 100 MB allocation page-faults in every batch). A buffer
    # goes back to the producer as soon as the writer has taken (copied or encoded) its frames.
    cuda = engine.device.type == "cuda"
    capturing = bool(engine.uncaptured())  # other buckets to capture in the loop (else: full batches from the 2nd)
    ring: list[torch.Tensor | None] = [None] * (QUEUE_BATCHES + 2)
    free: queue.Queue = queue.Queue()
    for k in range(QUEUE_BATCHES + 2):
        free.put(k)
    # Where each side spends its time (seconds): tells which stage limits a run.
    stages = {"produce_launch_s": 0.0,  # CPU time to schedule a batch and queue its GPU work
              "produce_buffer_wait_s": 0.0,  # waiting for a free host buffer: the writer is behind
              "produce_queue_wait_s": 0.0,  # waiting for room in the queue: the writer is behind
              "consume_wait_s": 0.0,  # waiting for the next batch to be queued: the producer is behind
              "consume_gpu_wait_s": 0.0,  # waiting for that batch's GPU work and copy to finish
              "consume_write_s": 0.0}  # handing frames to the encoder(s)

    marks: dict[str, float] = {"ring_ready_s": time.perf_counter() - t0}  # the first packet's path, from t0
    # The first batches take the first (captured) bucket. The other buckets are captured once the first
    # packet is out: a capture holds the GIL for a while, and the first segment's reply and mux need it.
    # Until then the first bucket goes on (at most EARLY_BATCHES), so the GPU and the encoders keep busy;
    # where the full bucket would not repay its capture, the first goes on to the end (later_capture_pays).
    first = min(engine.buckets[0], batch_size)
    first_out = threading.Event()  # set by the writer's side once the first video packet is muxed
    to_capture = len(items) > first and capturing  # after the first batch: what warm_up() may still capture
    full = not capturing  # batches of the full size (after the first): once their bucket is captured
    # the first bucket captured before the loop (capture "before"): the others may be left uncaptured
    skippable = options.engine.capture == "before"
    planned: collections.deque[tuple[int, int, list[FrameRequest]]] = collections.deque()  # hinted, in order
    next_start = 0

    def plan(size: int) -> None:
        """The next batch of `size` frames, told to the engine now (prefetch) and rendered in this order."""
        nonlocal next_start
        chunk = items[next_start:next_start + size]
        requests = [i.main for i in chunk] + [i.previous for i in chunk if i.previous is not None]
        engine.prefetch(requests)
        planned.append((next_start, next_start + len(chunk), requests))
        next_start += len(chunk)

    def produce() -> None:
        nonlocal to_capture, full
        try:
            early = 0  # batches rendered while the other buckets wait for their capture
            early_times: list[BatchTimer] = []
            while planned or next_start < len(items):
                if stop.is_set():
                    return
                t = time.perf_counter()
                while len(planned) < 1 + PREFETCH_BATCHES and next_start < len(items):
                    plan(batch_size if full and next_start > 0 else first)
                start, end, requests = planned.popleft()
                chunk = items[start:end]
                timer = BatchTimer(cuda) if to_capture else None  # the first bucket's rate, for the decision
                rendered = engine.render(requests)
                if timer is not None:
                    early_times.append(timer.stop(len(chunk)))
                batch = rendered[:len(chunk)]
                if len(requests) > len(chunk):  # crossfades: dissolve the previous scene's frames in
                    out, extra = [], len(chunk)
                    for j, item in enumerate(chunk):
                        frame = rendered[j]
                        if item.previous is not None:
                            frame = crossfade(rendered[extra], frame, item.weight)
                            extra += 1
                        out.append(frame)
                    batch = torch.stack(out)
                if render.compositor is not None:  # the show's layers, on the device, before the copy out
                    ts = time.perf_counter()
                    if batch.device.type != render.compositor.device.type:  # a server's live engine gives
                        batch = batch.to(render.compositor.device)  # host frames: painted on the GPU all the same
                    with torch.inference_mode():  # the engine's frames are inference tensors, painted in place
                        batch = render.compositor.apply(
                            batch, [(i.scene, float(i.local / fps), float((start + j) / fps)) for j, i in enumerate(chunk)])
                    stages["produce_show_s"] = stages.get("produce_show_s", 0.0) + time.perf_counter() - ts
                t1 = time.perf_counter()
                k = free.get()
                t2 = time.perf_counter()
                if ring[k] is None:  # each buffer when first needed: pinning ~100 MB is slow on a fresh VM's memory
                    ring[k] = torch.empty((batch_size, *batch.shape[1:]), dtype=batch.dtype, pin_memory=cuda)
                ring[k][:len(chunk)].copy_(batch, non_blocking=cuda)
                ready = None
                if cuda:
                    ready = torch.cuda.Event()
                    ready.record()
                frames.put((k, len(chunk), ready))
                marks.setdefault("first_batch_queued_s", time.perf_counter() - t0)
                stages["produce_launch_s"] += t1 - t
                stages["produce_buffer_wait_s"] += t2 - t1
                stages["produce_queue_wait_s"] += time.perf_counter() - t2
                early += to_capture
                if to_capture and (first_out.is_set() or early >= EARLY_BATCHES):
                    to_capture = False
                    left = len(items) - end
                    rate = first_bucket_rate(early_times)
                    if rate:
                        marks["first_bucket_fps"] = round(rate, 1)
                    if skippable and not later_capture_pays(left, rate):  # the first bucket to the end
                        marks["warmup_later_skipped_frames"] = left
                    else:
                        t = time.perf_counter()  # the other buckets, while the first frames encode
                        later = engine.warm_up()
                        marks.update({f"warmup later {name} s": v for name, v in later.items()})
                        marks["warmup_later_s"] = time.perf_counter() - t
                        marks["warmup_later_at_s"] = t - t0
                        full = True
                    marks["early_batches"] = early
            frames.put(done)
        except BaseException as e:  # hand any failure to the consumer, which raises it
            frames.put(e)

    producer = threading.Thread(target=produce, name="lipstream-render", daemon=True)
    bar = tqdm(total=len(items), unit="frame", desc=output.name, disable=not options.progress, smoothing=0.1)
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(min(switch_interval, LOOP_SWITCH_INTERVAL_S))
    try:
        with DeferredInterrupt() as interrupt, \
                writer(output, width, height, render.fps, render.audio48, crf=options.crf, x264_preset=options.x264_preset,
                       matrix=render.matrix, encoders=options.encoders, total_frames=len(items),
                       **({"processes": True} if options.encoder_processes else {})) as out:
            marks["writer_open_s"] = time.perf_counter() - t0
            # every thread's CPU and the encoder processes': are the cores full?
            worker_cpu = getattr(out, "worker_cpu_s", lambda: 0.0)
            loop_start, loop_cpu = time.perf_counter(), time.process_time() + worker_cpu()
            producer.start()
            while True:
                t = time.perf_counter()
                while True:
                    interrupt.check()  # here, not inside the queue's lock: the writer aborts cleanly
                    try:
                        batch = frames.get(timeout=0.002)
                        break
                    except queue.Empty:
                        out.poll()  # mux finished segments while waiting: the first packet goes out sooner
                        if out.first_packet_at is not None:
                            first_out.set()
                t1 = time.perf_counter()
                stages["consume_wait_s"] += t1 - t
                if batch is done:
                    break
                if isinstance(batch, BaseException):
                    raise batch
                k, count, ready = batch
                if ready is not None:
                    ready.synchronize()
                t2 = time.perf_counter()
                stages["consume_gpu_wait_s"] += t2 - t1
                t1 = t2
                host = ring[k].numpy()
                for i in range(count):
                    out.write(host[i])
                free.put(k)
                if out.first_packet_at is not None:
                    first_out.set()
                marks.setdefault("first_batch_written_s", time.perf_counter() - t0)
                stages["consume_write_s"] += time.perf_counter() - t1
                bar.update(count)
                if on_progress is not None:
                    on_progress(out.frames, len(items))
            interrupt.check()
            if out.frames != len(items):
                raise LipStreamError(f"rendered {out.frames} of {len(items)} frames")
            loop_end = time.perf_counter()
            stages["loop_s"] = loop_end - loop_start
            stages["loop_cpu_s"] = time.process_time() + worker_cpu() - loop_cpu
        report.first_frame_s = (out.first_packet_at or time.perf_counter()) - t0
        report.disk_bytes_written = out.disk_bytes_written
        if render.compositor is not None:
            stages["show_decoder_wait_s"] = render.compositor.decoder_wait_s()
        report.timings.update({k: round(v, 4) for k, v in stages.items()})
        if out.first_submit_at is not None:
            marks["first_segment_submitted_s"] = out.first_submit_at - t0
        report.timings.update({k: round(v, 4) for k, v in marks.items()})
        report.timings["finish_s"] = time.perf_counter() - loop_end  # flush: last segments, audio, faststart
    finally:
        stop.set()
        for k in range(QUEUE_BATCHES + 2):  # unblock a producer waiting for a host buffer...
            free.put(k)
        while producer.is_alive():  # ...or for room in the queue
            try:
                frames.get_nowait()
            except queue.Empty:
                producer.join(timeout=0.05)
        bar.close()
        sys.setswitchinterval(switch_interval)
        if render.compositor is not None:
            render.compositor.close()
    report.wall_s = time.perf_counter() - t0
    return report
