"""Prometheus metrics of one server (its own registry: two servers in one test process do not mix).

Handed the live engine and the job store, not the Service that owns them: the Service builds its
Metrics, so this module does not know the Service.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

if TYPE_CHECKING:
    from lipstream.live import LiveEngine
    from lipstream.serve.store.base import JobStore


class Metrics:
    """`closed_late`: frames played late in sessions already closed (the open ones are the engine's)."""

    def __init__(self, live: LiveEngine, store: JobStore, closed_late: Callable[[], int]):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("lipstream_http_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.job_seconds = Histogram("lipstream_job_seconds", "wall time of finished jobs", registry=r,
                                     buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800))
        self.frame_latency = Histogram("lipstream_live_frame_latency_seconds", "audio pushed -> frame encoded",
                                       registry=r, buckets=(0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.6, 1.0, 2.0))
        self.ready = Gauge("lipstream_ready", "1 once every cache is warm", registry=r)
        r.register(_Live(live, store, closed_late))
        ProcessCollector(registry=r)  # this process's CPU seconds and memory (a fleet's: per replica)
        GC_PAUSES.install()
        r.register(GC_PAUSES)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class _Live:
    """Read at each scrape: the engine's and the store's own counters."""

    def __init__(self, live: LiveEngine, store: JobStore, closed_late: Callable[[], int]):
        self.live, self.store, self.closed_late = live, store, closed_late

    def collect(self):
        live, store = self.live, self.store
        stats = live.stats
        yield GaugeMetricFamily("lipstream_live_sessions", "open live sessions", value=len(live.sessions))
        yield GaugeMetricFamily("lipstream_live_frames_rendered", "live frames through the steps",
                                value=stats.frames)
        yield GaugeMetricFamily("lipstream_live_idle_frames_kept", "idle frames from the kept loops",
                                value=stats.idle_cached_frames)
        yield GaugeMetricFamily("lipstream_offline_frames", "job frames through the steps", value=stats.offline_frames)
        yield GaugeMetricFamily("lipstream_engine_steps", "steps the engine ran", value=stats.steps)
        yield GaugeMetricFamily("lipstream_engine_steps_after_idle",
                                "steps launched after the one before had ended (the GPU idled between them)",
                                value=stats.steps_after_idle)
        yield GaugeMetricFamily("lipstream_engine_gpu_busy_seconds", "GPU time of the steps (0 on a CPU)",
                                value=stats.gpu_busy_s)
        yield GaugeMetricFamily("lipstream_engine_core_cpu_seconds",
                                "CPU time of the engine's core thread (one core at most: when it is full, frames are late)",
                                value=stats.core_cpu_s)
        yield GaugeMetricFamily("lipstream_live_frames_late", "frames played late, over all sessions so far",
                                value=sum(s.stats.late for s in list(live.sessions.values())) + self.closed_late())
        yield GaugeMetricFamily("lipstream_engine_capacity_fps", "frames/s admission counts with",
                                value=live.capacity_fps or 0.0)
        jobs = GaugeMetricFamily("lipstream_jobs", "jobs by status", labels=["status"])
        for status, n in store.counts().items():
            jobs.add_metric([status], n)
        yield jobs
        if live.device.type == "cuda":
            import torch

            yield GaugeMetricFamily("lipstream_gpu_memory_bytes", "GPU memory allocated",
                                    value=torch.cuda.memory_allocated(live.device))
            # what the caching allocator holds: a leak of cached blocks shows here first (serve-bench --soak)
            yield GaugeMetricFamily("lipstream_gpu_memory_reserved_bytes", "GPU memory reserved by torch's allocator",
                                    value=torch.cuda.memory_reserved(live.device))
            try:  # pinned host memory (torch's host allocator: blocks in use and cached); it counts in the RSS
                pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current")
            except (AttributeError, RuntimeError):  # a torch without it
                pinned = None
            if pinned is not None:
                yield GaugeMetricFamily("lipstream_pinned_host_memory_bytes",
                                        "pinned host memory held by torch's host allocator", value=pinned)


class GcPauses:
    """The interpreter's garbage collections and how long each held the GIL, by generation, read at each
    scrape. Why: a full collection of a process holding torch (and, in a fleet's replica, Ray) stops the
    engine's core thread for its whole length; a live session sees it as late frames. One per process
    (gc.callbacks is), installed by the first server's Metrics. Not prometheus_client's Histogram: its
    observe() takes a lock, and a collection that starts while this thread holds it (an allocation inside
    observe) would call back into observe and wait on that lock forever; here the callback only counts."""

    BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)

    def __init__(self):
        self._lock = threading.Lock()
        self._installed = False
        self._started: dict[int, float] = {}
        self._counts = [[0] * (len(self.BUCKETS) + 1) for _ in range(3)]  # per generation, per bucket (+Inf)
        self._sums = [0.0] * 3

    def install(self) -> None:
        with self._lock:
            if not self._installed:
                gc.callbacks.append(self._callback)
                self._installed = True

    def _callback(self, phase: str, info: dict) -> None:
        generation = min(2, info.get("generation", 2))
        if phase == "start":
            self._started[generation] = time.perf_counter()
            return
        seconds = time.perf_counter() - self._started.pop(generation, time.perf_counter())
        bucket = next((i for i, b in enumerate(self.BUCKETS) if seconds <= b), len(self.BUCKETS))
        self._counts[generation][bucket] += 1
        self._sums[generation] += seconds

    def collect(self):
        family = HistogramMetricFamily("lipstream_gc_pause_seconds", "garbage collections by generation and "
                                       "the time each held the interpreter", labels=["generation"])
        for generation in range(3):
            running, buckets = 0, []
            for bound, n in zip((*map(str, self.BUCKETS), "+Inf"), self._counts[generation]):
                running += n
                buckets.append((bound, running))
            family.add_metric([str(generation)], buckets, self._sums[generation])
        yield family


GC_PAUSES = GcPauses()
