"""Offline rendering: a program of scenes -> one H.264/AAC MP4, with nothing written in between.

`render_program` is two steps. `prepare` decodes the speech, computes its features and windows,
makes the avatars resident on the engine and plans every output frame (which avatar frame, which
audio window, which crossfade). `write` (loop.py) runs the plan: the engine's batches into
the encoders. The benchmark's ablations call the two steps with their own pieces (another window
builder, another writer); nothing else does.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from lipstream.audio.decode import load_mono
from lipstream.audio.features import whisper_features
from lipstream.audio.resample import resample
from lipstream.audio.windows import audio_windows
from lipstream.avatar import Avatar, load_avatar, ping_pong
from lipstream.avatar.cache import read_meta
from lipstream.avatar.resident import resident_avatar
from lipstream.engine.build import make_engine
from lipstream.engine.interface import FrameEngine, FrameRequest
from lipstream.errors import InputError
from lipstream.models.config import SAMPLE_RATE
from lipstream.render.options import RenderOptions
from lipstream.files import check_output_path
from lipstream.avatar.folders import resolve_avatar
from lipstream.media.rates import AUDIO_RATE
from lipstream.render.loop import RenderReport, write
from lipstream.render.plan import Item, RenderPlan
from lipstream.render.script import Program, Scene
from lipstream.show.build import build_compositor, scene_clock
from lipstream.show.compose import Compositor
from lipstream.show.mix import mix_music
from lipstream.show.spec import Show
from lipstream.show.tts import Voice, pick_voice

if TYPE_CHECKING:
    from lipstream.engine.aot import CompiledNetworks
    from lipstream.models import MuseTalk

Windows = Callable[[torch.Tensor, Fraction, int], torch.Tensor]  # features, fps, frames -> [frames, 50, 384]


def load_speech(path: Path, device: torch.device) -> tuple[torch.Tensor, np.ndarray]:
    """16 kHz samples on the device (for features) and 48 kHz samples on the CPU (for the output)."""
    mono, rate = load_mono(path)
    return resample(mono.to(device), rate, SAMPLE_RATE), resample(mono, rate, AUDIO_RATE).numpy()


def decode_speech(scenes: list[Scene], voice: Voice | None = None) -> list[tuple[torch.Tensor, int, np.ndarray]]:
    """Each scene's mono speech at its own rate and at 48 kHz (the output's track), all on the CPU: the part
    of the audio that needs no GPU, so it runs beside the graph capture. A text scene is spoken by `voice`
    (the TTS), in memory: no file is written."""
    out = []
    for scene in scenes:
        if scene.text is not None:
            samples, rate = voice.speak(scene.text)
            mono = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
        else:
            mono, rate = load_mono(scene.audio)
        out.append((mono, rate, resample(mono, rate, AUDIO_RATE).numpy()))
    return out


def scene_bounds(samples48: list[int], fps: Fraction) -> list[int]:
    """Each scene's first output frame from its speech's length at 48 kHz, the frame count last."""
    starts = np.cumsum([0] + samples48)
    bounds = [round(Fraction(int(n), AUDIO_RATE) * fps) for n in starts[:-1]]
    return bounds + [math.ceil(Fraction(int(starts[-1]), AUDIO_RATE) * fps)]


def build_show(show: Show, decoding: _Background, fps: Fraction, size: tuple[int, int], matrix: str,
               device: torch.device) -> tuple[np.ndarray, Compositor | None]:
    """The output's track (the speech, with the music bed ducked under it) and the show's layers, made on
    a thread beside the graph capture: sprites drawn, stills and videos opened, the bed decoded and mixed
    (CPU work that otherwise came before the first frame). Uploads go on a stream of their own, finished
    before this returns."""
    decoded = decoding.result()
    samples48 = np.concatenate([s48 for _, _, s48 in decoded])
    if show.music is not None:  # the bed under the speech, ducked where it speaks
        samples48 = mix_music(samples48, show.music, AUDIO_RATE)
    if not show.visual():
        return samples48, None
    clock = scene_clock(scene_bounds([s48.size for _, _, s48 in decoded], fps), fps)
    if device.type != "cuda":
        return samples48, build_compositor(show, size, float(fps), *clock, matrix, device)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        compositor = build_compositor(show, size, float(fps), *clock, matrix, device)
    stream.synchronize()
    return samples48, compositor


class _Background:
    """A function running on its own thread; `result()` joins it and re-raises what it raised."""

    def __init__(self, fn: Callable, *args):
        self._out: list = []
        self._thread = threading.Thread(target=self._run, args=(fn, *args), name="lipstream-prepare", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable, *args) -> None:
        try:
            self._out.append(fn(*args))
        except BaseException as e:  # noqa: BLE001  (raised in the caller's thread by result())
            self._out.append(e)

    def result(self):
        self._thread.join()
        if isinstance(self._out[0], BaseException):
            raise self._out[0]
        return self._out[0]

    def discard(self, close: Callable) -> None:
        """The caller failed: wait for the thread and `close` what it made (what it raised is dropped)."""
        self._thread.join()
        if not isinstance(self._out[0], BaseException):
            close(self._out[0])


def plan(program: Program, avatars: dict[str, int], engine: FrameEngine, fps: Fraction,
         scene_windows: list[torch.Tensor], bounds: list[int], silence: torch.Tensor | None) -> list[Item]:
    """The frame schedule: which avatar frame and audio window every output frame shows."""
    items: list[Item] = []

    def request(scene_index: int, local: int, window: torch.Tensor) -> FrameRequest:
        scene = program.scenes[scene_index]
        t = Fraction(local) / fps
        shot = [s for s in scene.shots if s.at <= t][-1]
        index = avatars[shot.avatar]
        avatar = engine.avatars[index]
        step = scene.start_frame + math.floor(t * avatar.fps)  # loops step by time, not by frame count
        return FrameRequest(index, ping_pong(step, avatar.num_frames), window)

    for k, scene in enumerate(program.scenes):
        for local in range(bounds[k + 1] - bounds[k]):
            item = Item(request(k, local, scene_windows[k][local]), scene=k, local=local)
            if k > 0 and local < scene.crossfade:  # the previous scene's camera runs on, mouth at rest
                prev_local = bounds[k] - bounds[k - 1] + local
                item.previous = request(k - 1, prev_local, silence)
                item.weight = (local + 1) / (scene.crossfade + 1)
            items.append(item)
    return items


def render_program(program: Program, output: str | Path, networks: MuseTalk | CompiledNetworks,
                   options: RenderOptions | None = None, *, engine: FrameEngine | None = None,
                   on_progress: Callable[[int, int], None] | None = None) -> RenderReport:
    """Render every scene of `program` into `output` (MP4). Nothing else is written.

    `options` left open (None fields) are chosen for the machine (RenderOptions.for_machine). Pass a
    warm `engine` (any FrameEngine) to reuse it: its graphs stay, its avatars are replaced.
    `on_progress(frames written, total)` is called after each batch (a service's job progress);
    whatever it raises stops the render, and nothing is written.
    """
    t0 = time.perf_counter()
    output = check_output_path(output)
    options = (options or RenderOptions()).for_machine(networks.device.type, os.cpu_count() or 1)
    options.check()
    engine = engine or make_engine(networks, options.engine)
    render = prepare(program, networks, engine, options, t0=t0)
    return write(render, output, options, on_progress=on_progress)


def prepare(program: Program, networks: MuseTalk | CompiledNetworks, engine: FrameEngine, options: RenderOptions, *,
            windows: Windows = audio_windows, features: Callable[[torch.Tensor], torch.Tensor] | None = None,
            per_scene: list[tuple[Callable, Windows]] | None = None, t0: float | None = None) -> RenderPlan:
    """The speech decoded, its features (`features` of the 16 kHz samples: Whisper's by default) and
    per-frame windows (`windows` builds them; `per_scene`: each scene's own (features, windows), where the
    scenes' models differ), the avatars resident on `engine` (their frames decoding in the background),
    every frame planned.

    The steps overlap where they can: the audio decodes on a thread (CPU) while the avatars load and the
    engine captures its graphs (GPU); the Whisper features (GPU) follow the capture."""
    t0 = time.perf_counter() if t0 is None else t0
    device = networks.device
    engine.clear_avatars()
    avatars_dir = program.avatars_dir or options.avatars_dir
    folders = {shot.avatar: resolve_avatar(shot.avatar, avatars_dir) for scene in program.scenes for shot in scene.shots}
    fps = Fraction(options.fps or program.fps or read_meta(folders[program.scenes[0].shots[0].avatar])["fps"])
    show = program.show
    voice = pick_voice(show.voice) if any(scene.text is not None for scene in program.scenes) else None
    decoding = _Background(decode_speech, program.scenes, voice)

    indices: dict[str, int] = {}
    load = resident_avatar if options.resident else functools.partial(load_avatar, background=True)
    for name, folder in folders.items():  # frames keep decoding in the background while the render starts
        indices[name] = engine.add_avatar(load(folder, device, vae_fingerprint=networks.fingerprints.get("vae")))
    first: Avatar = engine.avatars[indices[program.scenes[0].shots[0].avatar]]
    width, height = first.size
    for a in engine.avatars:
        if a.size != (width, height):
            raise InputError(a.path, f"is {a.size[0]}x{a.size[1]}, the broadcast is {width}x{height}: "
                                     "all avatars of one video must have the same frame size")
    t_load = time.perf_counter()
    building = _Background(build_show, show, decoding, fps, (width, height), first.meta["colour_matrix"], device)
    try:
        # CUDA graphs (and compile) before the frames need them: here the first batch's bucket (every
        # one when crossfades may double a batch); the others while that batch encodes (write), so the
        # first frames are not held up by them
        crossfades = any(scene.crossfade for scene in program.scenes)
        later = options.engine.capture == "later" and not crossfades  # the first batch uncaptured
        captured = {} if later else engine.warm_up(None if crossfades else engine.buckets[:1])
        t_warm = time.perf_counter()
        decoded = decoding.result()
        t_decoded = time.perf_counter()
        speech = [resample(mono.to(device), rate, SAMPLE_RATE) for mono, rate, _ in decoded]
        bounds = scene_bounds([s48.size for _, _, s48 in decoded], fps)
        features = features or functools.partial(whisper_features, networks=networks)
        per_scene = per_scene or [(features, windows)] * len(speech)
        scene_windows = [per_scene[k][1](per_scene[k][0](s16), fps, max(1, bounds[k + 1] - bounds[k]))
                         for k, s16 in enumerate(speech)]
        silence = None  # the mouth at rest, for the outgoing scene of a crossfade
        if crossfades:
            quiet = features(torch.zeros(SAMPLE_RATE, device=device))  # 1 s: 50 steps (both kinds are 50 Hz)
            silence = windows(quiet, fps, math.ceil(Fraction(quiet.shape[0]) * fps / 50))[int(fps) // 2]
        t_audio = time.perf_counter()
        items = plan(program, indices, engine, fps, scene_windows, bounds, silence)
        t_plan = time.perf_counter()
        samples48, compositor = building.result()
    except BaseException:
        building.discard(lambda built: built[1] is not None and built[1].close())
        raise
    # decode_wait_s: how long the decode outlasted the capture (0 when it was hidden behind it); show_wait_s:
    # how long the show's layers and music outlasted the capture, the features and the plan
    timings = {"load_s": t_load - t0, "warmup_s": t_warm - t_load, "decode_wait_s": t_decoded - t_warm,
               "audio_s": t_audio - t_decoded, "plan_s": t_plan - t_audio, "show_wait_s": time.perf_counter() - t_plan,
               **{f"warmup {name} s": v for name, v in captured.items()}}
    return RenderPlan(engine, items, samples48, fps, (width, height), first.meta["colour_matrix"], t0, timings,
                      compositor)


