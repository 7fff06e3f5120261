"""N Pipecat pipelines in one process on one LiveEngine: does every one get its fps, with its audio in step?

Each pipeline is `LipStreamVideoService -> sink` in a PipelineWorker of its own, all on one event
loop (a process hosting N bots), fed like a TTS in real time: 20 ms `TTSAudioRawFrame` chunks,
utterances of 2-5 s with 0.5-1.5 s pauses between them, a TTSStartedFrame / TTSStoppedFrame
around each. The sink keeps each picture's arrival time and whether the audio after a speech
picture is its own. Per N: each pipeline's picture fps over the measured window (after the first
picture and a settling second), frames late (the session's counters), speech pictures without their
audio (misaligned), Pipecat errors the services reported (a refused session: `errors`), and the
gaps between consecutive pictures (p99, max).

    python -m lipstream.bench.pipecat_load --avatar avatars/anna --random-weights --n 1,8,16,24 --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
from pipecat.frames.frames import (
    EndFrame,
    Frame,
    OutputImageRawFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner

from lipstream.fixtures import speech_like
from lipstream.integrations.pipecat import UTTERANCE_KEY, LipStreamVideoService
from lipstream.live import LiveEngine

CHUNK_S = 0.02  # a TTS's chunk
SPEECH_RATE = 24_000  # what most TTS services speak
UTTERANCE_S = (2.0, 5.0)
PAUSE_S = (0.5, 1.5)
SETTLE_S = 1.0  # the window starts this long after a pipeline's first picture


class PictureSink(FrameProcessor):
    """The end of a bench pipeline: each picture's arrival time, and whether its audio followed it."""

    def __init__(self, expect: int):
        super().__init__(enable_direct_mode=True)
        self.arrivals = np.zeros(expect, np.float64)  # grown if needed; no per-frame allocation beyond the list
        self.images = self.speech_images = self.misaligned = self.audio_frames = 0
        self._waiting_audio = False  # a speech picture came; its audio is next

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if isinstance(frame, OutputImageRawFrame):
            if self._waiting_audio:
                self.misaligned += 1  # the previous speech picture's audio never came
            if self.images == self.arrivals.size:
                self.arrivals = np.concatenate([self.arrivals, np.zeros_like(self.arrivals)])
            self.arrivals[self.images] = time.monotonic()
            self.images += 1
            self._waiting_audio = frame.metadata.get(UTTERANCE_KEY) is not None
            self.speech_images += self._waiting_audio
        elif isinstance(frame, TTSAudioRawFrame):
            self.audio_frames += 1
            if not self._waiting_audio:
                self.misaligned += 1  # audio that no speech picture came before
            self._waiting_audio = False
        else:
            await self.push_frame(frame, direction)  # StartFrame, EndFrame, the stops: the worker waits for them


async def _feed(worker: PipelineWorker, seconds: float, seed: int) -> None:
    """A TTS speaking in real time: utterances and pauses, 20 ms chunks on an absolute schedule."""
    rng = np.random.default_rng(seed)
    step = round(SPEECH_RATE * CHUNK_S)
    end = time.monotonic() + seconds
    await asyncio.sleep(rng.uniform(*PAUSE_S))  # pipelines do not all start speaking at one moment
    while time.monotonic() < end:
        length = rng.uniform(*UTTERANCE_S)
        pcm = (np.clip(speech_like(length, SPEECH_RATE, seed=int(rng.integers(1 << 30))), -1, 1) * 32767).astype(np.int16)
        await worker.queue_frame(TTSStartedFrame())
        t = time.monotonic()
        for k, i in enumerate(range(0, pcm.size, step)):
            await worker.queue_frame(TTSAudioRawFrame(audio=pcm[i:i + step].tobytes(), sample_rate=SPEECH_RATE,
                                                      num_channels=1))
            await asyncio.sleep(max(0.0, t + (k + 1) * CHUNK_S - time.monotonic()))
        await worker.queue_frame(TTSStoppedFrame())
        await asyncio.sleep(rng.uniform(*PAUSE_S))


def _pipeline_figures(sink: PictureSink, window: tuple[float, float]) -> dict:
    t = sink.arrivals[:sink.images]
    if t.size < 2:
        return {"images": int(t.size), "fps": 0.0, "interval_p99_ms": None, "interval_max_ms": None}
    lo = max(window[0], t[0] + SETTLE_S)
    inside = t[(t >= lo) & (t <= window[1])]
    gaps = np.diff(inside) if inside.size > 1 else np.zeros(1)
    return {"images": int(t.size), "fps": round(float(inside.size / max(1e-9, window[1] - lo)), 2),
            "interval_p99_ms": round(float(np.percentile(gaps, 99)) * 1000, 1),
            "interval_max_ms": round(float(gaps.max()) * 1000, 1)}


async def _run(engine: LiveEngine | None, avatar: str | int, n: int, seconds: float, size: tuple[int, int] | None,
               fps: float, playout_delay_s: float | None, url: str | None, api_key: str | None) -> dict:
    where = dict(engine=engine) if url is None else dict(url=url, api_key=api_key)
    services = [LipStreamVideoService(**where, avatar=avatar, size=size, fps=fps, playout_delay_s=playout_delay_s)
                for _ in range(n)]
    sinks = [PictureSink(int((seconds + 10) * fps)) for _ in range(n)]
    workers = [PipelineWorker(Pipeline([s, k]), params=PipelineParams(audio_out_sample_rate=48_000),
                              cancel_on_idle_timeout=False, check_dangling_tasks=False)
               for s, k in zip(services, sinks)]
    started = [asyncio.Event() for _ in workers]
    for w, e in zip(workers, started):
        _when_started(w, e)
    errors: list[str] = []  # Pipecat errors the services reported (a refused session, a failed push)
    for s in services:
        _count_errors(s, errors)
    runner = WorkerRunner()
    await runner.add_workers(*workers)
    stats: list = [None] * n
    window: list[float] = [0.0, 0.0]

    async def drive() -> None:
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        delay = playout_delay_s or (engine.o.playout_delay_s if engine is not None else 0.25)
        window[0] = time.monotonic() + delay
        await asyncio.gather(*(_feed(w, seconds, seed=k) for k, w in enumerate(workers)))
        await asyncio.sleep(delay + 0.5)  # the last speech plays out
        window[1] = time.monotonic()
        for k, s in enumerate(services):
            stats[k] = s.session.stats if s.session is not None else None
        for w in workers:
            await w.queue_frame(EndFrame())

    await asyncio.gather(runner.run(), drive())
    rows = [_pipeline_figures(k, (window[0], window[1])) for k in sinks]
    fps_all = [r["fps"] for r in rows]
    p99 = [r["interval_p99_ms"] for r in rows if r["interval_p99_ms"] is not None]
    return {"n": n, "seconds": seconds, "fps": float(fps), "size": list(services[0].size or ()) or None,
            "opened": sum(st is not None for st in stats), "errors": len(errors), "first_error": errors[0] if errors else None,
            "fps_min": min(fps_all), "fps_median": float(np.median(fps_all)),
            "images": sum(k.images for k in sinks), "speech_images": sum(k.speech_images for k in sinks),
            "audio_frames": sum(k.audio_frames for k in sinks), "misaligned": sum(k.misaligned for k in sinks),
            "late": sum(st.late for st in stats if st is not None),
            "late_speech": sum(st.late_speech for st in stats if st is not None),
            "interval_p99_ms": max(p99) if p99 else None,
            "interval_max_ms": max((r["interval_max_ms"] for r in rows if r["interval_max_ms"] is not None), default=None),
            "pipelines": rows}


def _count_errors(service: LipStreamVideoService, errors: list[str]) -> None:
    @service.event_handler("on_error")
    async def reported(processor, error):
        errors.append(error.error)


def _when_started(worker: PipelineWorker, event: asyncio.Event) -> None:
    @worker.event_handler("on_pipeline_started")
    async def started(worker, frame):
        event.set()


def run(engine: LiveEngine | None, avatar: str | int, n: int, seconds: float, size: tuple[int, int] | None = None,
        fps: float = 25, playout_delay_s: float | None = None, *, url: str | None = None,
        api_key: str | None = None) -> dict:
    """N pipelines for `seconds` of real-time TTS each, on a started engine in this process, or (`url`,
    engine None) on a `lipstream serve` in another (frames late: counted at the client); the figures of
    this N. Runs its own event loop (call it from synchronous code)."""
    if (engine is None) == (url is None):
        raise ValueError("engine, url: exactly one is allowed")
    if n < 1:
        raise ValueError(f"n: {n}; 1 or more pipelines are allowed")
    if seconds <= 0:
        raise ValueError(f"seconds: {seconds}; more than 0 is allowed")
    return asyncio.run(_run(engine, avatar, n, seconds, size, Fraction(fps).limit_denominator(1001), playout_delay_s,
                            url, api_key))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--avatar", required=True, help="a compiled avatar folder")
    p.add_argument("--n", default="1,4,8,16,24", help="pipelines per row, comma-separated")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--fps", type=float, default=25.0)
    p.add_argument("--size", default=None, help="WxH of the pictures out (default: the avatar's)")
    p.add_argument("--models", default=None)
    p.add_argument("--random-weights", action="store_true", help="random networks (speed only, never passed off as real)")
    p.add_argument("--model-size", default="full", help="with --random-weights: full or tiny")
    p.add_argument("--device", default="auto")
    p.add_argument("--options", default="realtime", help="a LiveOptions preset")
    p.add_argument("--playout-delay-s", type=float, default=None)
    p.add_argument("--inductor", default="off")
    a = p.parse_args(argv)
    from lipstream.live import preset, start_engine

    size = tuple(int(v) for v in a.size.lower().split("x")) if a.size else None
    options = preset(a.options).replace(encode=False)
    with start_engine([a.avatar], models=a.models, random_weights=a.random_weights, size=a.model_size,
                      device=a.device, options=options, inductor=a.inductor) as engine:
        name = Path(a.avatar).name
        for n in [int(v) for v in a.n.split(",")]:
            row = run(engine, name, n, a.seconds, size=size, fps=a.fps, playout_delay_s=a.playout_delay_s)
            print(json.dumps({k: v for k, v in row.items() if k != "pipelines"}), flush=True)


if __name__ == "__main__":
    main()
