"""Prometheus metrics of one server (its own registry: two servers in one test process do not mix).

Handed the live engine and the job store, not the Service that owns them: the Service builds its
Metrics, so this module does not know the Service.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from lipstream.live import LiveEngine
    from lipstream.serve.store import JobStore


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
