"""A planned render: what program.py's `prepare` makes and loop.py's `write` runs (its own module so the
render loop's producer reads it without importing the loop)."""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from lipstream.engine.interface import FrameEngine, FrameRequest
from lipstream.show.compose import Compositor


@dataclass
class Item:
    """What one output frame is: a request, or two with a dissolve weight for the second."""

    main: FrameRequest
    previous: FrameRequest | None = None
    weight: float = 1.0
    scene: int = 0  # which scene of the program it belongs to (the show's layers are per scene)
    local: int = 0  # its frame number from that scene's start


@dataclass
class RenderPlan:
    """Everything a render needs besides the frames themselves (`prepare` makes it)."""

    engine: FrameEngine
    items: list[Item]
    audio48: np.ndarray  # the output's track, 48 kHz mono
    fps: Fraction
    size: tuple[int, int]  # width, height
    matrix: str  # the colour matrix the frames were blended in
    t0: float  # perf_counter() at the start
    timings: dict[str, float] = field(default_factory=dict)
    compositor: Compositor | None = None  # the show's layers (None: none paints, the render pays nothing)
