"""What a render can be asked to do: the engine's options and the output's (x264, encoders, frame rate).

Kept free of torch: the CLI checks a user's options with these before anything heavy is imported.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction
from pathlib import Path

from lipstream.engine.options import EngineOptions

X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow",
                "placebo")
MAX_FPS = 240
MAX_ENCODERS = 64


@dataclass(frozen=True)
class RenderOptions:
    """A render: the engine's options and the output's. `fps` None: the first avatar's. `x264_preset`,
    `encoders` (parallel x264 segment encoders), `encoder_processes` (those encoders in worker processes,
    not threads) and `engine.batch` None: chosen for the machine (`for_machine`). `resident`: the avatars
    stay loaded for the process's next renders."""

    engine: EngineOptions = field(default_factory=EngineOptions)
    fps: Fraction | None = None
    crf: int = 18
    x264_preset: str | None = None
    encoders: int | None = None
    encoder_processes: bool | None = None
    avatars_dir: Path | None = None
    resident: bool = True
    progress: bool = True

    def check(self) -> None:
        """ValueError naming the field and what is allowed."""
        self.engine.check()
        if not 0 <= self.crf <= 51:
            raise ValueError(f"crf {self.crf}: an x264 quality from 0 to 51 is allowed")
        if self.x264_preset is not None and self.x264_preset not in X264_PRESETS:
            raise ValueError(f"x264_preset {self.x264_preset!r}: one of {', '.join(X264_PRESETS)} is allowed")
        if self.encoders is not None and not 1 <= self.encoders <= MAX_ENCODERS:
            raise ValueError(f"encoders {self.encoders}: 1 to {MAX_ENCODERS} are allowed")
        if self.fps is not None and not 0 < self.fps <= MAX_FPS:
            raise ValueError(f"fps {self.fps}: above 0 and at most {MAX_FPS} is allowed")

    def for_machine(self, device_type: str, cores: int) -> RenderOptions:
        """What the user left open, chosen for this machine.

        On a GPU the engine outruns x264 (625 fps core on the H200 against about 300 fps of 1080p
        veryfast on 16 cores), so the encoder gets the fastest preset and the engine large batches,
        and its segment encoders run in processes of their own: as threads their Python shares the
        producer's GIL and kept 4 of 16 cores busy. On a CPU the networks are the bottleneck, veryfast
        (smaller files) costs nothing that shows, and threads are enough.
        """
        gpu = device_type == "cuda"
        encoders = self.encoders or default_encoders(cores)
        processes = self.encoder_processes
        return replace(self, engine=self.engine.for_device(device_type),
                       x264_preset=self.x264_preset or ("ultrafast" if gpu else "veryfast"), encoders=encoders,
                       encoder_processes=(gpu and encoders > 1) if processes is None else processes)

    def replace(self, **changes) -> RenderOptions:
        return replace(self, **changes)


def default_encoders(cores: int) -> int:
    """Parallel x264 segment encoders: one per 2 cores, at most 8; one below 8 cores, where a single
    encoder with every thread is best (docs/BENCHMARKS.md)."""
    return min(8, cores // 2) if cores >= 8 else 1
