"""N Pipecat pipelines on one engine: does every one get its fps, with its audio in step?

Each pipeline is `LipStreamVideoService -> sink` in a PipelineWorker of its own, all on one event
loop (a process hosting N bots), fed like a TTS in real time: 20 ms `TTSAudioRawFrame` chunks,
utterances of 2-5 s with 0.5-1.5 s pauses between them, a TTSStartedFrame / TTSStoppedFrame
around each. The sink keeps each picture's arrival time and whether the audio after a speech
picture is its own. Per N: each pipeline's picture fps over the measured window (after the first
picture and a settling second), frames late (the session's counters), speech pictures without their
audio (misaligned), Pipecat errors the services reported (a refused session: `errors`), and the
gaps between consecutive pictures (p99, max).

As bots are deployed (`bots`): N processes, one pipeline each, against one `lipstream serve` (`url=`),
each pipeline's output through a real transport (SmallWebRTC) to a WebRTC viewer of its own (aiortc,
in the bot's process, on loopback), whose pictures are counted too (`client_fps_min`).

    python -m lipstream.bench.pipecat_load --avatar avatars/anna --random-weights --n 1,8,16,24 --seconds 20
    python -m lipstream.bench.pipecat_load --url http://gpu:8000 --avatar anna --n 8,16 --bots --seconds 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
from pipecat.observers.base_observer import BaseObserver, FramePushed
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner

from lipstream.aio import wait_for
from lipstream.bench.proc import CoresUsed, cores_of_processes, rows_of_processes
from lipstream.fixtures import speech_like
from lipstream.integrations.pipecat import UTTERANCE_KEY, LipStreamVideoService
from lipstream.live import LiveEngine

CHUNK_S = 0.02  # a TTS's chunk
SPEECH_RATE = 24_000  # what most TTS services speak
UTTERANCE_S = (2.0, 5.0)
PAUSE_S = (0.5, 1.5)
SETTLE_S = 1.0  # the window starts this long after a pipeline's first picture


class PictureCount:
    """Each picture's arrival time, and whether its audio followed it."""

    def __init__(self, expect: int):
        self.arrivals = np.zeros(expect, np.float64)  # grown if needed; no per-frame allocation beyond the list
        self.images = self.speech_images = self.misaligned = self.audio_frames = 0
        self._waiting_audio = False  # a speech picture came; its audio is next

    def count(self, frame: Frame) -> bool:
        """Whether `frame` was a picture or its audio (counted)."""
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
            return False
        return True


class PictureSink(FrameProcessor, PictureCount):
    """The end of a bench pipeline: its pictures and their audio counted and dropped."""

    def __init__(self, expect: int):
        FrameProcessor.__init__(self, enable_direct_mode=True)
        PictureCount.__init__(self, expect)

    async def process_frame(self, frame: Frame, direction: FrameDirection):
        await super().process_frame(frame, direction)
        if not self.count(frame):
            await self.push_frame(frame, direction)  # StartFrame, EndFrame, the stops: the worker waits for them


class PushedPictures(BaseObserver, PictureCount):
    """The pictures and audio a service pushes on to the transport after it, counted as a sink counts them."""

    def __init__(self, service: FrameProcessor, expect: int):
        BaseObserver.__init__(self)
        PictureCount.__init__(self, expect)
        self.service = service

    async def on_push_frame(self, data: FramePushed):
        if data.source is self.service and data.direction == FrameDirection.DOWNSTREAM:
            self.count(data.frame)


class Viewer:
    """A WebRTC viewer of one bot's transport, in the bot's process: the arrival time of each picture."""

    def __init__(self):
        self.video: list[float] = []
        self.drawn: list[float] = []  # when the bot's output transport wrote each picture to it
        self.audio_frames = 0
        self.client = self.connection = None
        self._readers: list[asyncio.Task] = []

    async def connect(self):
        """The viewer's offer answered by the bot's SmallWebRTCConnection (loopback); the connection."""
        from aiortc import RTCPeerConnection, RTCSessionDescription
        from pipecat.transports.smallwebrtc.connection import SmallWebRTCConnection

        self.client = RTCPeerConnection()
        self.client.addTransceiver("audio", direction="recvonly")
        self.client.addTransceiver("video", direction="recvonly")
        await self.client.setLocalDescription(await self.client.createOffer())
        self.connection = SmallWebRTCConnection()
        await self.connection.initialize(sdp=self.client.localDescription.sdp, type=self.client.localDescription.type)
        answer = self.connection.get_answer()
        await self.client.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type=answer["type"]))
        self._readers = [asyncio.ensure_future(self._read(t.receiver.track)) for t in self.client.getTransceivers()]
        return self.connection

    async def _read(self, track) -> None:
        try:
            while True:
                await track.recv()
                if track.kind == "video":
                    self.video.append(time.monotonic())
                else:
                    self.audio_frames += 1
        except Exception:  # noqa: BLE001 (the track ended)
            return

    async def close(self) -> None:
        for r in self._readers:
            r.cancel()
        if self.client is not None:
            await self.client.close()


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


def _count_draws(output, drawn: list[float]) -> None:
    """Note when the output transport writes each picture (its own pace, not the pipeline's).

    Pipecat's output shows `sync_with_audio` images by making each the current picture and redrawing the
    current picture in a loop that sleeps a frame's duration after each draw: 1 / (1/fps + a draw's time),
    about 24.4 a second for 25 fps, whatever the source. What a viewer can get is what was drawn."""
    write = output.write_video_frame

    async def counted(frame):
        drawn.append(time.monotonic())
        return await write(frame)

    output.write_video_frame = counted


def _pipeline_figures(sink: PictureCount, window: tuple[float, float]) -> dict:
    return _picture_figures(sink.arrivals[:sink.images], window)


def _picture_figures(t: np.ndarray, window: tuple[float, float]) -> dict:
    """Pictures' arrival times -> their rate over the window (after the first and a settling second) and gaps."""
    if t.size < 2:
        return {"images": int(t.size), "fps": 0.0, "interval_p99_ms": None, "interval_max_ms": None}
    lo = max(window[0], t[0] + SETTLE_S)
    inside = t[(t >= lo) & (t <= window[1])]
    gaps = np.diff(inside) if inside.size > 1 else np.zeros(1)
    return {"images": int(t.size), "fps": round(float(inside.size / max(1e-9, window[1] - lo)), 2),
            "interval_p99_ms": round(float(np.percentile(gaps, 99)) * 1000, 1),
            "interval_max_ms": round(float(gaps.max()) * 1000, 1)}


async def _run(engine: LiveEngine | None, avatar: str | int, n: int, seconds: float, size: tuple[int, int] | None,
               fps: float, playout_delay_s: float | None, url: str | None, api_key: str | None,
               transport: bool = False, start_at: float | None = None) -> dict:
    where = dict(engine=engine) if url is None else dict(url=url, api_key=api_key)
    services = [LipStreamVideoService(**where, avatar=avatar, size=size, fps=fps, playout_delay_s=playout_delay_s)
                for _ in range(n)]
    viewers: list[Viewer] = []
    if transport:  # each pipeline's output through SmallWebRTC to a viewer of its own
        from pipecat.transports.base_transport import TransportParams
        from pipecat.transports.smallwebrtc.transport import SmallWebRTCTransport

        if size is None:
            raise ValueError("size: (width, height) is needed with a transport (its video_out size)")
        viewers = [Viewer() for _ in range(n)]
        outputs = [SmallWebRTCTransport(webrtc_connection=await v.connect(), params=TransportParams(
            audio_out_enabled=True, audio_out_sample_rate=48_000, video_out_enabled=True, video_out_width=size[0],
            video_out_height=size[1], video_out_framerate=round(float(fps)))).output() for v in viewers]
        for out, v in zip(outputs, viewers):
            _count_draws(out, v.drawn)
        sinks = [PushedPictures(s, int((seconds + 10) * fps)) for s in services]
        workers = [PipelineWorker(Pipeline([s, o]), params=PipelineParams(audio_out_sample_rate=48_000),
                                  observers=[k], cancel_on_idle_timeout=False, check_dangling_tasks=False)
                   for s, o, k in zip(services, outputs, sinks)]
    else:
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
    cores, used = CoresUsed(), {}  # this process's CPU (its pipelines, transports, viewers) while they speak

    async def drive() -> None:
        await wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        if start_at is not None:  # bots in processes of their own start speaking together
            await asyncio.sleep(max(0.0, start_at - time.time()))
        delay = playout_delay_s or (engine.o.playout_delay_s if engine is not None else 0.25)
        window[0] = time.monotonic() + delay
        cores.start()
        await asyncio.gather(*(_feed(w, seconds, seed=k) for k, w in enumerate(workers)))
        await asyncio.sleep(delay + 0.5)  # the last speech plays out
        window[1] = time.monotonic()
        used.update(cores.stop())
        for k, s in enumerate(services):
            stats[k] = s.session.stats if s.session is not None else None
        for w in workers:
            await w.queue_frame(EndFrame())

    try:
        await asyncio.gather(runner.run(), drive())
    finally:
        for v in viewers:
            await v.close()
    rows = [_pipeline_figures(k, (window[0], window[1])) for k in sinks]
    for row, v in zip(rows, viewers):  # what each viewer received through the transport
        seen = _picture_figures(np.array(v.video), (window[0], window[1]))
        row.update({"client_" + k: value for k, value in seen.items()}, client_audio_frames=v.audio_frames,
                   transport_fps=_picture_figures(np.array(v.drawn), (window[0], window[1]))["fps"])
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
            **({"client_fps_min": min(r["client_fps"] for r in rows),
                "client_share_min": min(_share(r) for r in rows),
                "transport_fps_min": min(r["transport_fps"] for r in rows),
                "client_interval_max_ms": max((r["client_interval_max_ms"] or 0) for r in rows)} if viewers else {}),
            **used, "pipelines": rows}


def _share(row: dict) -> float:
    """The share of the pictures its transport drew that a viewer received (over the window)."""
    return round(row["client_fps"] / row["transport_fps"], 3) if row["transport_fps"] else 0.0


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
        api_key: str | None = None, transport: bool = False, start_at: float | None = None) -> dict:
    """N pipelines for `seconds` of real-time TTS each, on a started engine in this process, or (`url`,
    engine None) on a `lipstream serve` in another (frames late: counted at the client); the figures of
    this N. `transport`: each pipeline's output through SmallWebRTC to a viewer of its own. `start_at`
    (time.time()): when to start speaking. Runs its own event loop (call it from synchronous code)."""
    if (engine is None) == (url is None):
        raise ValueError("engine, url: exactly one is allowed")
    if n < 1:
        raise ValueError(f"n: {n}; 1 or more pipelines are allowed")
    if seconds <= 0:
        raise ValueError(f"seconds: {seconds}; more than 0 is allowed")
    return asyncio.run(_run(engine, avatar, n, seconds, size, Fraction(fps).limit_denominator(1001), playout_delay_s,
                            url, api_key, transport, start_at))


BOT_START_S = 15.0  # bot processes import Pipecat and connect before they speak together
TOTALS = ("opened", "errors", "images", "speech_images", "audio_frames", "misaligned", "late", "late_speech")


def bots(url: str, avatar: str, n: int, seconds: float, size: tuple[int, int], fps: float = 25, *,
         api_key: str | None = None, playout_delay_s: float | None = None) -> dict:
    """N bots as they are deployed: N processes of one pipeline each against the `lipstream serve` at `url`,
    each through a real transport (SmallWebRTC) to a viewer of its own, all speaking from one moment; the
    figures of this N, the pipelines' as `run` gives them (`processes_failed`: bots that reported nothing), and
    the cores the bots used while speaking beside how busy the machine was (they share it with the server)."""
    env = {**os.environ, "LIPSTREAM_API_KEY": api_key or os.environ.get("LIPSTREAM_API_KEY", "")}
    start = time.time() + BOT_START_S
    cmd = ["--url", url, "--avatar", avatar, "--n", "1", "--seconds", str(seconds), "--fps", str(fps), "--size",
           f"{size[0]}x{size[1]}", "--transport", "--start", str(start),
           *(["--playout-delay-s", str(playout_delay_s)] if playout_delay_s is not None else [])]
    results = rows_of_processes("lipstream.bench.pipecat_load", [cmd] * n, BOT_START_S + seconds + 90, env)
    rows = [r for r in results if isinstance(r, dict)]
    failed = [[r] for r in results if isinstance(r, str)]
    pipelines = [r for row in rows for r in row["pipelines"]]
    fps_all = [r["fps"] for r in pipelines] or [0.0]
    return {"n": n, "seconds": seconds, "fps": float(fps), "size": list(size), "processes": n,
            "processes_failed": len(failed), "first_failure": failed[0][0] if failed else None,
            **{k: sum(row[k] for row in rows) for k in TOTALS},
            "first_error": next((row["first_error"] for row in rows if row["first_error"]), None),
            "fps_min": min(fps_all) if not failed else 0.0, "fps_median": float(np.median(fps_all)),
            "interval_p99_ms": max((row["interval_p99_ms"] or 0) for row in rows) if rows else None,
            "interval_max_ms": max((row["interval_max_ms"] or 0) for row in rows) if rows else None,
            "client_fps_min": min((row["client_fps_min"] for row in rows), default=0.0) if not failed else 0.0,
            "client_share_min": min((row["client_share_min"] for row in rows), default=0.0) if not failed else 0.0,
            "transport_fps_min": min((row["transport_fps_min"] for row in rows), default=0.0) if not failed else 0.0,
            "client_interval_max_ms": max((row["client_interval_max_ms"] for row in rows), default=None),
            **cores_of_processes(rows), "pipelines": pipelines}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--avatar", required=True, help="a compiled avatar folder (with --url: a resident avatar's name)")
    p.add_argument("--url", default=None, help="a running lipstream serve (its key: $LIPSTREAM_API_KEY)")
    p.add_argument("--bots", action="store_true", help="with --url: a process per pipeline, each through a transport")
    p.add_argument("--transport", action="store_true", help="each pipeline's output through SmallWebRTC to a viewer")
    p.add_argument("--start", type=float, default=None, help="time.time() at which to start speaking")
    p.add_argument("--out", type=Path, default=None, help="the last row as JSON here")
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
    size = tuple(int(v) for v in a.size.lower().split("x")) if a.size else None
    if a.url is not None:  # the engine in a lipstream serve; the pipelines here, or (--bots) a process each
        key = os.environ.get("LIPSTREAM_API_KEY") or None
        for n in [int(v) for v in a.n.split(",")]:
            row = (bots(a.url, a.avatar, n, a.seconds, size, a.fps, api_key=key, playout_delay_s=a.playout_delay_s)
                   if a.bots else run(None, a.avatar, n, a.seconds, size=size, fps=a.fps, playout_delay_s=a.playout_delay_s,
                                      url=a.url, api_key=key, transport=a.transport, start_at=a.start))
            if a.out is not None:
                tmp = a.out.with_suffix(".part")
                tmp.write_text(json.dumps(row))
                tmp.replace(a.out)
            print(json.dumps({k: v for k, v in row.items() if k != "pipelines"}), flush=True)
        return
    from lipstream.live import preset, start_engine

    options = preset(a.options).replace(encode=False)
    with start_engine([a.avatar], models=a.models, random_weights=a.random_weights, size=a.model_size,
                      device=a.device, options=options, inductor=a.inductor) as engine:
        name = Path(a.avatar).name
        for n in [int(v) for v in a.n.split(",")]:
            row = run(engine, name, n, a.seconds, size=size, fps=a.fps, playout_delay_s=a.playout_delay_s)
            print(json.dumps({k: v for k, v in row.items() if k != "pipelines"}), flush=True)


if __name__ == "__main__":
    main()
