"""`render_program` with KeySync: the same program, avatars, render loop and MP4, KeySync's frames for the scenes
that ask for it (`model: keysync`, or all of them) and MuseTalk's for the others."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from lipstream.audio.features import whisper_features
from lipstream.audio.windows import audio_windows
from lipstream.avatar import Avatar
from lipstream.engine.interface import FrameEngine, FrameRequest
from lipstream.errors import LipStreamError
from lipstream.files import check_output_path
from lipstream.keysync.engine import KeySyncEngine, KeySyncModels, windows
from lipstream.keysync.options import KeySyncOptions
from lipstream.render.loop import RenderReport, write
from lipstream.render.options import RenderOptions
from lipstream.render.program import prepare
from lipstream.render.script import Program, scene_models


class ScenesEngine:
    """Two engines behind one FrameEngine: MuseTalk's for some scenes' requests, KeySync's for the others'
    (told apart by the requests themselves, handed over by `schedule`)."""

    def __init__(self, musetalk: FrameEngine, keysync: KeySyncEngine):
        self.musetalk, self.keysync = musetalk, keysync
        self.device = musetalk.device
        self.buckets = musetalk.buckets
        self._keysync_requests: set[int] = set()

    @property
    def avatars(self) -> list[Avatar]:
        return self.musetalk.avatars

    def add_avatar(self, avatar: Avatar) -> int:
        index = self.musetalk.add_avatar(avatar)
        if self.keysync.add_avatar(avatar) != index:
            raise RuntimeError("ScenesEngine: the two engines numbered an avatar differently")
        return index

    def clear_avatars(self) -> None:
        self.musetalk.clear_avatars()
        self.keysync.clear_avatars()

    def warm_up(self, buckets: tuple[int, ...] | None = None) -> dict[str, float]:
        return self.musetalk.warm_up(buckets)

    def uncaptured(self) -> tuple[int, ...]:
        return self.musetalk.uncaptured()

    def prefetch(self, requests: list[FrameRequest]) -> None:
        self.musetalk.prefetch([r for r in requests if id(r) not in self._keysync_requests])

    def schedule(self, scenes: list[list[FrameRequest]], models: list[str]) -> None:
        ours = [scene for scene, model in zip(scenes, models) if model == "keysync"]
        self._keysync_requests = {id(r) for scene in ours for r in scene}
        self.keysync.schedule(ours)

    def render(self, requests: list[FrameRequest]) -> torch.Tensor:
        runs: list[tuple[bool, list[FrameRequest]]] = []
        for r in requests:  # consecutive requests of one model, in order
            ks = id(r) in self._keysync_requests
            if runs and runs[-1][0] == ks:
                runs[-1][1].append(r)
            else:
                runs.append((ks, [r]))
        if len(runs) == 1:
            return (self.keysync if runs[0][0] else self.musetalk).render(requests)
        # a view of an engine's buffer is valid only until its next call: each run copied out
        return torch.cat([(self.keysync if ks else self.musetalk).render(part).clone() for ks, part in runs])


def render_keysync(program: Program, output: str | Path, models: KeySyncModels, options: RenderOptions | None = None,
                   keysync: KeySyncOptions | None = None, *, default: str = "keysync", musetalk=None,
                   musetalk_engine: FrameEngine | None = None,
                   on_progress: Callable[[int, int], None] | None = None,
                   check: Callable[[], None] | None = None) -> RenderReport:
    """Render `program` into `output` (MP4), KeySync's frames for the scenes whose model is keysync (`default`:
    the model of scenes that name none) and, given its networks `musetalk` (and an engine of them, else a
    fresh one), MuseTalk's for the others. Nothing else is written. `check()` runs between KeySync's UNet
    calls: what it raises stops the render there (`on_progress` is called only as frames are written, and a
    chunk of KeySync's frames takes minutes)."""
    t0 = time.perf_counter()
    kinds = scene_models(program, default)
    for k, scene in enumerate(program.scenes):
        if scene.crossfade and "keysync" in (kinds[k], kinds[k - 1]):
            raise LipStreamError(f"scene {k + 1}: KeySync scenes cut: a crossfade into or out of one is not "
                                 "supported (transition: cut)")
    if "musetalk" in kinds and musetalk is None:
        raise LipStreamError("scenes for MuseTalk need its networks beside KeySync's")
    output = check_output_path(output)
    options = (options or RenderOptions()).for_machine(models.device.type, os.cpu_count() or 1)
    options.check()
    (keysync or KeySyncOptions()).check()
    engine = KeySyncEngine(models, keysync, check)
    if "musetalk" in kinds:
        from lipstream.engine.build import make_engine

        engine = ScenesEngine(musetalk_engine or make_engine(musetalk, options.engine), engine)
        whisper = functools.partial(whisper_features, networks=musetalk)
        per_scene = [(models.features, windows) if k == "keysync" else (whisper, audio_windows) for k in kinds]
        render = prepare(program, musetalk, engine, options, per_scene=per_scene, t0=t0)
    else:
        render = prepare(program, models, engine, options, windows=windows, features=models.features, t0=t0)
    scenes = [[item.main for item in render.items if item.scene == k] for k in range(len(program.scenes))]
    if isinstance(engine, ScenesEngine):
        engine.schedule(scenes, kinds)
    else:
        engine.schedule(scenes)
    return write(render, output, options, on_progress=on_progress)
