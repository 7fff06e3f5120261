"""Offline rendering: a program of scenes -> one H.264/AAC MP4, with nothing written in between.

A producer thread schedules frames and runs the engine (GPU work); the main thread encodes and
muxes. They meet in a bounded queue, so memory stays flat and both sides stay busy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import functools
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import cv2
import numpy as np
import torch
from tqdm import tqdm

from lipstream.audio.decode import load_mono
from lipstream.audio.features import whisper_features
from lipstream.audio.resample import resample
from lipstream.audio.windows import audio_windows, audio_windows_loop
from lipstream.avatar import Avatar, load_avatar, ping_pong
from lipstream.avatar.cache import read_meta
from lipstream.avatar.resident import resident_avatar
from lipstream.engine import Engine, FrameRequest, ReferenceEngine
from lipstream.engine.blend import crossfade
from lipstream.errors import InputError, LipStreamError
from lipstream.interrupts import DeferredInterrupt
from lipstream.preflight import check_output_path, default_encoders, resolve_avatar
from lipstream.media import mp4 as media_mp4
from lipstream.media.mp4 import MP4Writer
from lipstream.rates import AUDIO_RATE
from lipstream.models.config import SAMPLE_RATE
from lipstream.script import Program

if TYPE_CHECKING:
    from lipstream.models import MuseTalk

QUEUE_BATCHES = 4  # batches of frames in flight between the GPU and the encoder
FIRST_BATCH = 8  # the first batch is small: the first encoded frame comes out sooner


@dataclass
class Item:
    """What one output frame is: a request, or two with a dissolve weight for the second."""

    main: FrameRequest
    previous: FrameRequest | None = None
    weight: float = 1.0


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


def load_speech(path: Path, device: torch.device) -> tuple[torch.Tensor, np.ndarray]:
    """16 kHz samples on the device (for features) and 48 kHz samples on the CPU (for the output)."""
    mono, rate = load_mono(path)
    return resample(mono.to(device), rate, SAMPLE_RATE), resample(mono, rate, AUDIO_RATE).numpy()


def plan(program: Program, avatars: dict[str, int], engine: Engine, fps: Fraction,
         scene_windows: list[torch.Tensor], bounds: list[int], silence: torch.Tensor | None) -> list[Item]:
    """The frame schedule: which avatar frame and audio window every output frame shows."""
    items: list[Item] = []

    def request(scene_index: int, local: int, window: torch.Tensor) -> FrameRequest:
        scene = program.scenes[scene_index]
        t = Fraction(local) / fps
        shot = [s for s in scene.shots if s.at <= t][-1]
        slot = avatars[shot.avatar]
        avatar = engine.avatars[slot]
        step = scene.start_frame + math.floor(t * avatar.fps)  # loops step by time, not by frame count
        return FrameRequest(slot, ping_pong(step, avatar.num_frames), window)

    for k, scene in enumerate(program.scenes):
        for local in range(bounds[k + 1] - bounds[k]):
            item = Item(request(k, local, scene_windows[k][local]))
            if k > 0 and local < scene.crossfade:  # the previous scene's camera runs on, mouth at rest
                prev_local = bounds[k] - bounds[k - 1] + local
                item.previous = request(k - 1, prev_local, silence)
                item.weight = (local + 1) / (scene.crossfade + 1)
            items.append(item)
    return items


def render_program(program: Program, output: str | Path, models: MuseTalk, *, avatars_dir: Path | None = None,
                   fps: Fraction | None = None, reference: bool = False, batch_size: int = 16, crf: int = 18,
                   preset: str = "veryfast", encoders: int | None = None, encoder_processes: bool | None = None,
                   compile: str | bool = "off", segment_frames: int = 32, progress: bool = True,
                   engine: Engine | None = None, gather_windows: bool = True, first_batch: int = FIRST_BATCH,
                   compile_vae: bool = False, writer: Callable[..., MP4Writer] = MP4Writer,
                   decode_rows: str = "auto", resident: bool = True,
                   on_progress: Callable[[int, int], None] | None = None) -> RenderReport:
    """Render every scene of `program` into `output` (MP4). Nothing else is written.

    `encoders`: parallel x264 segment encoders (default: one per 2 CPU cores, at most 8; 1 on
    small machines, where one encoder with all threads is best); `encoder_processes` runs them as
    a persistent pool of processes instead of threads (slower on the H200: frames are pickled).
    `compile`: "vae" or "all" to Inductor-compile the VAE decoder or the whole network step (slow
    first start, cached on disk; `compile_vae=True` is "vae"). Pass an `engine` to reuse a warm
    one (its graphs stay; its avatars are replaced). `gather_windows=False` builds the audio
    windows with upstream's per-frame loop (for the benchmark's ablation); `writer` replaces the
    MP4 writer (the benchmark's disk-based ablation); `decode_rows` "auto" (the default) decodes
    only the face rows the blend uses where the avatar's mask allows it, "full" the whole face
    (exact), "mask" refuses avatars it cannot crop (engine/decode.py). The avatars' frames decode
    in the background while the render starts; with `resident` they stay loaded for the
    process's next renders (avatar/resident.py). `on_progress(frames written, total)` is called
    after each batch (a service's job progress); whatever it raises stops the render, nothing written.
    """
    t0 = time.perf_counter()
    output = check_output_path(output)
    device = models.device
    if engine is None:
        buckets = (min(first_batch, batch_size), batch_size)
        engine = ReferenceEngine(models) if reference else Engine(models, batch_size, buckets=buckets,
                                                                  compile="vae" if compile_vae else compile,
                                                                  decode_rows=decode_rows)
    engine.clear_avatars()
    avatars_dir = program.avatars_dir or avatars_dir
    folders = {shot.avatar: resolve_avatar(shot.avatar, avatars_dir) for scene in program.scenes for shot in scene.shots}
    fps = Fraction(fps or program.fps or read_meta(folders[program.scenes[0].shots[0].avatar])["fps"])

    # The audio first: it is short GPU work that the frame decoding below would slow down.
    speech = [load_speech(scene.audio, device) for scene in program.scenes]
    samples48 = np.concatenate([s[1] for s in speech])
    starts = np.cumsum([0] + [s[1].size for s in speech])
    bounds = [round(Fraction(int(n), AUDIO_RATE) * fps) for n in starts[:-1]]
    bounds.append(math.ceil(Fraction(int(starts[-1]), AUDIO_RATE) * fps))
    windows = []
    for k, (s16, _) in enumerate(speech):
        features = whisper_features(s16, models.whisper, models.feature_extractor)
        make_windows = audio_windows if gather_windows else audio_windows_loop
        windows.append(make_windows(features, fps, max(1, bounds[k + 1] - bounds[k])))
    silence = None  # the mouth at rest, for the outgoing scene of a crossfade
    if any(scene.crossfade for scene in program.scenes):
        quiet = whisper_features(torch.zeros(SAMPLE_RATE, device=device), models.whisper, models.feature_extractor)
        silence = audio_windows(quiet, fps)[int(fps) // 2]
    t_audio = time.perf_counter()

    slots: dict[str, int] = {}
    load = resident_avatar if resident else functools.partial(load_avatar, background=True)
    for name, folder in folders.items():  # frames keep decoding in the background while the render starts
        slots[name] = engine.add_avatar(load(folder, device, vae_fingerprint=models.fingerprints.get("vae")))
    first: Avatar = engine.avatars[slots[program.scenes[0].shots[0].avatar]]
    width, height = first.size
    for a in engine.avatars:
        if a.size != (width, height):
            raise InputError(a.path, f"is {a.size[0]}x{a.size[1]}, the broadcast is {width}x{height}: "
                                     "all avatars of one video must have the same frame size")
    t_load = time.perf_counter()
    if encoders is None:
        encoders = default_encoders(os.cpu_count() or 1)
    processes = bool(encoder_processes)  # threads measured faster: frames cross no process boundary
    if processes and encoders > 1:
        media_mp4.encoder_processes(encoders)  # start the encoder processes during warm-up (once per process)
    engine.warm_up()  # CUDA graphs (and compile) before the first frame, not during it
    t_warm = time.perf_counter()
    items = plan(program, slots, engine, fps, windows, bounds, silence)

    report = RenderReport(output, len(items), fps, float(Fraction(samples48.size, AUDIO_RATE)), 0.0, 0.0,
                          {"audio_s": t_audio - t0, "load_s": t_load - t_audio, "warmup_s": t_warm - t_load,
                           "plan_s": time.perf_counter() - t_warm})
    report.timings["encoders"] = encoders
    report.timings["encoder_processes"] = processes
    _run(engine, items, batch_size, output, width, height, fps, samples48, first.meta["colour_matrix"],
         crf, preset, encoders, processes, segment_frames, progress, report, t0, writer, on_progress)
    report.wall_s = time.perf_counter() - t0
    return report


def _run(engine: Engine, items: list[Item], batch_size: int, output: Path, width: int, height: int, fps: Fraction,
         audio: np.ndarray, matrix: str, crf: int, preset: str, encoders: int, processes: bool, segment: int,
         progress: bool, report: RenderReport, t0: float, make_writer: Callable[..., MP4Writer] = MP4Writer,
         on_progress: Callable[[int, int], None] | None = None) -> None:
    frames: queue.Queue = queue.Queue(maxsize=QUEUE_BATCHES)
    stop = threading.Event()
    done = object()
    # Host frames land in a ring of batch buffers allocated once (pinned on CUDA, so the copy is an
    # async DMA, and no fresh 100 MB allocation page-faults in every batch). A slot goes back to
    # the producer as soon as the writer has taken (copied or encoded) its frames.
    cuda = engine.device.type == "cuda"
    rgb = getattr(engine, "rgb_output", False)  # an RGB engine (the benchmark's ablation): convert on the CPU
    shape = (height, width, 3) if rgb else (height * 3 // 2, width)
    ring = [torch.empty((batch_size, *shape), dtype=torch.uint8, pin_memory=cuda) for _ in range(QUEUE_BATCHES + 2)]
    free: queue.Queue = queue.Queue()
    for slot in range(len(ring)):
        free.put(slot)
    # Where each side spends its time (seconds): tells which stage limits a run.
    stages = {"produce_launch_s": 0.0,  # CPU time to schedule a batch and queue its GPU work
              "produce_slot_wait_s": 0.0,  # waiting for a free host slot: the writer is behind
              "produce_queue_wait_s": 0.0,  # waiting for room in the queue: the writer is behind
              "consume_wait_s": 0.0,  # waiting for the next batch to be queued: the producer is behind
              "consume_gpu_wait_s": 0.0,  # waiting for that batch's GPU work and copy to finish
              "consume_write_s": 0.0}  # handing frames to the encoder(s)

    marks: dict[str, float] = {"ring_ready_s": time.perf_counter() - t0}  # the first packet's path, from t0
    first = min(engine.buckets[0], batch_size)
    starts = [0, *range(first, len(items), batch_size)] if len(items) > first else [0]
    ends = starts[1:] + [len(items)]

    def produce() -> None:
        try:
            for start, end in zip(starts, ends):
                if stop.is_set():
                    return
                t = time.perf_counter()
                chunk = items[start:end]
                requests = [i.main for i in chunk] + [i.previous for i in chunk if i.previous is not None]
                rendered = engine.render(requests)
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
                t1 = time.perf_counter()
                slot = free.get()
                t2 = time.perf_counter()
                ring[slot][:len(chunk)].copy_(batch, non_blocking=cuda)
                ready = None
                if cuda:
                    ready = torch.cuda.Event()
                    ready.record()
                frames.put((slot, len(chunk), ready))
                marks.setdefault("first_batch_queued_s", time.perf_counter() - t0)
                stages["produce_launch_s"] += t1 - t
                stages["produce_slot_wait_s"] += t2 - t1
                stages["produce_queue_wait_s"] += time.perf_counter() - t2
            frames.put(done)
        except BaseException as e:  # hand any failure to the consumer, which raises it
            frames.put(e)

    producer = threading.Thread(target=produce, name="lipstream-render", daemon=True)
    bar = tqdm(total=len(items), unit="frame", desc=output.name, disable=not progress, smoothing=0.1)
    try:
        with DeferredInterrupt() as interrupt, \
                make_writer(output, width, height, fps, audio, crf=crf, preset=preset, matrix=matrix,
                            encoders=encoders, processes=processes, segment=segment,
                            total_frames=len(items)) as writer:
            marks["writer_open_s"] = time.perf_counter() - t0
            producer.start()
            while True:
                t = time.perf_counter()
                while True:
                    interrupt.check()  # here, not inside the queue's lock: the writer aborts cleanly
                    try:
                        batch = frames.get(timeout=0.002)
                        break
                    except queue.Empty:
                        writer.poll()  # mux finished segments while waiting: the first packet goes out sooner
                t1 = time.perf_counter()
                stages["consume_wait_s"] += t1 - t
                if batch is done:
                    break
                if isinstance(batch, BaseException):
                    raise batch
                slot, count, ready = batch
                if ready is not None:
                    ready.synchronize()
                t2 = time.perf_counter()
                stages["consume_gpu_wait_s"] += t2 - t1
                t1 = t2
                host = ring[slot].numpy()
                for i in range(count):
                    writer.write(cv2.cvtColor(host[i], cv2.COLOR_RGB2YUV_I420) if rgb else host[i])
                free.put(slot)
                marks.setdefault("first_batch_written_s", time.perf_counter() - t0)
                stages["consume_write_s"] += time.perf_counter() - t1
                bar.update(count)
                if on_progress is not None:
                    on_progress(writer.frames, len(items))
            interrupt.check()
            if writer.frames != len(items):
                raise LipStreamError(f"rendered {writer.frames} of {len(items)} frames")
            loop_end = time.perf_counter()
        report.first_frame_s = (writer.first_packet_at or time.perf_counter()) - t0
        report.disk_bytes_written = getattr(writer, "disk_bytes_written", 0)
        report.timings.update({k: round(v, 4) for k, v in stages.items()})
        if getattr(writer, "first_submit_at", None):
            marks["first_segment_submitted_s"] = writer.first_submit_at - t0
        report.timings.update({k: round(v, 4) for k, v in marks.items()})
        report.timings["finish_s"] = time.perf_counter() - loop_end  # flush: last segments, audio, faststart
    finally:
        stop.set()
        for slot in range(len(ring)):  # unblock a producer waiting for a host slot...
            free.put(slot)
        while producer.is_alive():  # ...or for room in the queue
            try:
                frames.get_nowait()
            except queue.Empty:
                producer.join(timeout=0.05)
        bar.close()
