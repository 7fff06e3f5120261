"""The benchmark scenarios, built reproducibly from generated avatars and speech.

A: a 3-scene multi-presenter broadcast, 12.0 s, three different avatars, cuts between them.
B: a 25.8 s single-presenter monologue at 30 fps (775 frames).
Landmarks come from the fixtures' ground truth (the photo's 68 points moved by each frame's
transform), so building a scenario needs no face model and no tracking time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lipstream.avatar import compile_avatar
from lipstream.avatar.boxes import TEMPLATE_LANDMARKS as PHOTO_LANDMARKS  # the astronaut photo's 68 points
from lipstream.fixtures import speech_like, write_audio
from lipstream.fixtures.avatar import action_loop
from lipstream.models import MuseTalk
from lipstream.render.script import Program, Scene, Shot


@dataclass
class Scenario:
    name: str
    description: str
    program: Program
    seconds: float


def _avatar(work: Path, name: str, models: MuseTalk, width: int, height: int, fps: int, seed: int) -> None:
    loop = work / f"{name}.mp4"
    truth = action_loop(loop, width=width, height=height, seconds=4.0, fps=fps, seed=seed, motion=1.0 + 0.5 * seed)
    homogeneous = np.concatenate([PHOTO_LANDMARKS, np.ones((68, 1), np.float32)], axis=1)
    landmarks = np.einsum("nij,kj->nki", truth.transforms, homogeneous)
    track = work / f"{name}.track.json"
    track.write_text(json.dumps({"landmarks": np.round(landmarks, 2).tolist()}))
    compile_avatar(loop, work / "avatars", models.vae, models.fingerprints["vae"], track_file=track, progress=False)


def build(work: Path, models: MuseTalk, *, width: int = 1920, height: int = 1080, scale: float = 1.0) -> list[Scenario]:
    """Both scenarios under `work`; `scale` shortens every duration (for CPU smoke runs)."""
    work.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(("anna", "ben", "cleo")):
        _avatar(work, name, models, width, height, 25, i)
    _avatar(work, "ruby", models, width, height, 30, 3)
    scenes = []
    for i, name in enumerate(("anna", "ben", "cleo")):
        audio = write_audio(work / f"a{i}.wav", speech_like(4.0 * scale, 16000, seed=10 + i), 16000)
        scenes.append(Scene(audio, [Shot(0.0, name)]))
    mono = write_audio(work / "monologue.wav", speech_like(775 / 30 * scale, 16000, seed=20), 16000)
    return [
        Scenario("A", f"3-scene broadcast, three presenters, cuts, {12.0 * scale:.1f} s at 25 fps",
                 Program(scenes, avatars_dir=work / "avatars"), 12.0 * scale),
        Scenario("B", f"single-presenter monologue, {25.8 * scale:.1f} s at 30 fps",
                 Program([Scene(mono, [Shot(0.0, "ruby")])], avatars_dir=work / "avatars"), 25.8 * scale),
    ]


def warm_up_program(work: Path, built: list[Scenario]) -> Program:
    """A short program over every avatar of the scenarios: warms an engine before it is timed."""
    names = sorted({shot.avatar for s in built for scene in s.program.scenes for shot in scene.shots})
    audio = write_audio(work / "warm.wav", speech_like(0.5, 16000, seed=99), 16000)
    return Program([Scene(audio, [Shot(0.0, name)]) for name in names], avatars_dir=built[0].program.avatars_dir)
