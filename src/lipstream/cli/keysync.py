"""The KeySync parts of `lipstream compile` (--keysync) and `render | broadcast` (a scene whose model is
keysync): the files checked before anything loads, then KeySync's work (lipstream.keysync)."""

from __future__ import annotations

from pathlib import Path

from lipstream.cli.checks import check_models
from lipstream.cli.common import err, mark_finished, out, process_age, report_line, warn_random_weights
from lipstream.errors import LipStreamError
from lipstream.models.config import random_size_for
from lipstream.render.options import RenderOptions


def prepare_keysync(folders: list[Path], models, random_weights: bool, random_size: str, dev) -> None:
    """compile --keysync: each avatar's KeySync latents and masks (keysync/avatar.py), beside MuseTalk's."""
    from lipstream.avatar import load_avatar
    from lipstream.keysync.avatar import prepare_avatar
    from lipstream.keysync.load import TINY_SIZE, load_svd_vae, random_vae
    from lipstream.models.layout import models_dir

    size = random_size_for(random_size, dev.type) if random_weights else "full"
    vae = random_vae(size, dev) if random_weights else load_svd_vae(models_dir(models), dev)
    for folder in folders:
        path = prepare_avatar(load_avatar(folder, dev), vae, 512 if size == "full" else TINY_SIZE, dev)
        out.print(f"{folder.name}: KeySync's latents and masks in {path.name}", highlight=False)


def render_keysync_cli(program, output: Path, options: RenderOptions, device: str, random_size: str, models,
                    random_weights: bool, preset: str, kinds: list[str], compile: str, model: str) -> None:
    """`render`/`broadcast` where a scene's model is keysync: the files checked before anything loads, then
    KeySync's render (MuseTalk's networks beside it for the scenes of that model)."""
    for k, scene in enumerate(program.scenes):
        if k and scene.crossfade and "keysync" in (kinds[k], kinds[k - 1]):
            raise LipStreamError(f"scene {k + 1}: KeySync scenes cut: a crossfade into or out of one is not "
                                 "supported (transition: cut)")
    if "musetalk" in kinds:
        check_models(models, random_weights)
    if not random_weights:
        from lipstream.models.download import MODEL_FILES, missing_files
        from lipstream.models.layout import HOW_TO_GET, models_dir

        missing = missing_files(models_dir(models), MODEL_FILES["keysync"])
        if missing:
            raise LipStreamError(f"KeySync's weights are not in {models_dir(models)} (missing {missing[0].path}); "
                                 f"{HOW_TO_GET.replace('download', 'download --model keysync')}; or try it without "
                                 "them: --random-weights (untrained networks, the mouth is noise)")
    from lipstream.engine.networks import pick_device
    from lipstream.keysync.load import load_keysync, random_keysync
    from lipstream.keysync.options import KEYSYNC_PRESETS
    from lipstream.keysync.render import render_keysync
    from lipstream.models.layout import models_dir

    dev = pick_device(device)
    size = random_size_for(random_size, dev.type)
    if random_weights:
        warn_random_weights()
        keysync = random_keysync(size, dev)
    else:
        keysync = load_keysync(models_dir(models), dev)
    err.print(f"{keysync.note} on {dev}, preset {preset}", highlight=False)
    musetalk = None
    if "musetalk" in kinds:  # the other scenes' model
        from lipstream.engine.networks import load_networks

        musetalk = load_networks(models, dev, random_weights, size, compile=compile,
                                 decode_rows=options.engine.decode_rows,
                                 report=lambda line: err.print(line, highlight=False)).models
    report = render_keysync(program, output, keysync, options, KEYSYNC_PRESETS[preset], default=model,
                            musetalk=musetalk)
    out.print(report_line(report, "KeySync"))
    out.print(f"process: {process_age():.2f} s", highlight=False)
    if random_weights:
        out.print("[bold red]random weights: the mouth is noise, not speech[/]")
    mark_finished()
