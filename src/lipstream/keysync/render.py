"""`render_program` with KeySync: the same program, avatars, render loop and MP4, KeySync's frames."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from lipstream.errors import LipStreamError
from lipstream.files import check_output_path
from lipstream.keysync.engine import KeySyncEngine, KeySyncModels, windows
from lipstream.keysync.options import KeySyncOptions
from lipstream.render.loop import RenderReport, write
from lipstream.render.options import RenderOptions
from lipstream.render.program import prepare
from lipstream.render.script import Program


def render_keysync(program: Program, output: str | Path, models: KeySyncModels, options: RenderOptions | None = None,
                   keysync: KeySyncOptions | None = None, *,
                   on_progress: Callable[[int, int], None] | None = None) -> RenderReport:
    """Render every scene of `program` with KeySync into `output` (MP4). Nothing else is written."""
    t0 = time.perf_counter()
    if any(scene.crossfade for scene in program.scenes):
        raise LipStreamError("KeySync renders cut between scenes: crossfades are not supported (set crossfade: 0)")
    output = check_output_path(output)
    options = (options or RenderOptions()).for_machine(models.device.type, os.cpu_count() or 1)
    options.check()
    (keysync or KeySyncOptions()).check()
    engine = KeySyncEngine(models, keysync)
    render = prepare(program, models, engine, options, windows=windows, features=models.features, t0=t0)
    engine.schedule([[item.main for item in render.items if item.scene == k] for k in range(len(program.scenes))])
    return write(render, output, options, on_progress=on_progress)
