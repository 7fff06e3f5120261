"""The render loop: a planned render's frames through the engine into the MP4 writer, nothing on disk between.

A producer thread (producer.py) runs the engine batch by batch (GPU work, the show's layers painted on the
device) into a ring of pinned host buffers; the caller's thread hands the frames to the writer, which encodes
and muxes. They meet in a bounded queue, so memory stays flat and both sides stay busy. Here: the loop's
settings, including the rule for when the engine's other buckets are captured (after the first packet, and
only where they repay the stop), the writer's side, and `write`, which wires the two at a short GIL switch
interval. program.py makes the plan (`prepare`, plan.py); the benchmark's ablations hand `write` other writers.
"""

from __future__ import annotations

import queue
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Protocol

import numpy as np
from tqdm import tqdm

from lipstream.errors import LipStreamError
from lipstream.media.mp4 import MP4Writer
from lipstream.media.rates import AUDIO_RATE
from lipstream.render.interrupts import DeferredInterrupt
from lipstream.render.options import RenderOptions
from lipstream.render.plan import RenderPlan
from lipstream.render.producer import DONE, BatchProducer, HostRing, LoopTimes

QUEUE_BATCHES = 4  # batches of frames in flight between the GPU and the encoder
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


def later_capture_pays(left: int, rate: float | None) -> bool:
    """Whether capturing the full bucket now repays its stop (see FULL_BUCKET_SPEEDUP): unknown rate, it does."""
    if rate is None:
        return True
    return left / rate * (1 - 1 / FULL_BUCKET_SPEEDUP) > LATER_CAPTURE_COST_S


def next_batch(producer: BatchProducer, out: VideoWriter, interrupt: DeferredInterrupt):
    """The producer's next item; while it waits, finished segments are muxed (the first packet goes out
    sooner) and an interrupt is raised, here rather than inside the queue's lock: the writer aborts cleanly."""
    while True:
        interrupt.check()
        try:
            return producer.batches.get(timeout=0.002)
        except queue.Empty:
            out.poll()
            if out.first_packet_at is not None:
                producer.first_packet_out.set()


def write_batches(producer: BatchProducer, out: VideoWriter, interrupt: DeferredInterrupt, times: LoopTimes,
                  bar: tqdm, on_progress: Callable[[int, int], None] | None) -> None:
    """The writer's side: each batch, once its GPU work and copy are done, handed to the encoders and its
    buffer given back, until DONE; what the producer raised is raised here."""
    while True:
        t = time.perf_counter()
        batch = next_batch(producer, out, interrupt)
        t1 = time.perf_counter()
        times.add("consume_wait_s", t1 - t)
        if batch is DONE:
            return
        if isinstance(batch, BaseException):
            raise batch
        k, count, ready = batch
        if ready is not None:
            ready.synchronize()
        t2 = time.perf_counter()
        times.add("consume_gpu_wait_s", t2 - t1)
        host = producer.ring.frames(k)
        for i in range(count):
            out.write(host[i])
        producer.ring.give_back(k)
        if out.first_packet_at is not None:
            producer.first_packet_out.set()
        times.mark_first("first_batch_written_s")
        times.add("consume_write_s", time.perf_counter() - t2)
        bar.update(count)
        if on_progress is not None:
            on_progress(out.frames, len(producer.items))


def write(render: RenderPlan, output: Path, options: RenderOptions, *,
          writer: Callable[..., VideoWriter] = MP4Writer,
          on_progress: Callable[[int, int], None] | None = None) -> RenderReport:
    """Run the plan into `output` through `writer` (an MP4Writer with the options' x264 settings)."""
    engine, items, t0 = render.engine, render.items, render.t0
    width, height = render.size
    report = RenderReport(output, len(items), render.fps, float(Fraction(render.audio48.size, AUDIO_RATE)), 0.0,
                          0.0, dict(render.timings))
    report.timings["encoders"] = options.encoders
    batches: queue.Queue = queue.Queue(maxsize=QUEUE_BATCHES)  # (buffer, frames, ready event), then DONE
    capture_in_loop = bool(engine.uncaptured())  # other buckets to capture (else: full batches from the 2nd)
    # a buffer for each queued batch, the one being written and the one being filled
    ring = HostRing(QUEUE_BATCHES + 2, engine.buckets[-1], pinned=engine.device.type == "cuda")
    times = LoopTimes(t0)
    times.mark("ring_ready_s")  # the first packet's path, from t0
    producer = BatchProducer(render, batches, ring, times, capture_in_loop=capture_in_loop,
                             skippable=options.engine.capture == "before",
                             early_batches=EARLY_BATCHES, capture_pays=later_capture_pays)
    bar = tqdm(total=len(items), unit="frame", desc=output.name, disable=not options.progress, smoothing=0.1)
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(min(switch_interval, LOOP_SWITCH_INTERVAL_S))
    try:
        with DeferredInterrupt() as interrupt, \
                writer(output, width, height, render.fps, render.audio48, crf=options.crf, x264_preset=options.x264_preset,
                       matrix=render.matrix, encoders=options.encoders, total_frames=len(items),
                       **({"processes": True} if options.encoder_processes else {})) as out:
            times.mark("writer_open_s")
            # every thread's CPU and the encoder processes': are the cores full?
            worker_cpu = getattr(out, "worker_cpu_s", lambda: 0.0)
            loop_start, loop_cpu = time.perf_counter(), time.process_time() + worker_cpu()
            producer.thread.start()
            write_batches(producer, out, interrupt, times, bar, on_progress)
            interrupt.check()
            if out.frames != len(items):
                raise LipStreamError(f"rendered {out.frames} of {len(items)} frames")
            loop_end = time.perf_counter()
            times.stages["loop_s"] = loop_end - loop_start
            times.stages["loop_cpu_s"] = time.process_time() + worker_cpu() - loop_cpu
        report.first_frame_s = (out.first_packet_at or time.perf_counter()) - t0
        report.disk_bytes_written = out.disk_bytes_written
        if render.compositor is not None:
            times.stages["show_decoder_wait_s"] = render.compositor.decoder_wait_s()
        if out.first_submit_at is not None:
            times.marks["first_segment_submitted_s"] = out.first_submit_at - t0
        report.timings.update(times.timings())
        report.timings["finish_s"] = time.perf_counter() - loop_end  # flush: last segments, audio, faststart
    finally:
        producer.shut_down()
        bar.close()
        sys.setswitchinterval(switch_interval)
        if render.compositor is not None:
            render.compositor.close()
    report.wall_s = time.perf_counter() - t0
    return report
