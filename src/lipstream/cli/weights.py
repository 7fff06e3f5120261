"""`lipstream weights`: get, check or fake the model files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from lipstream.cli.common import ModelsOpt, err, out, warn_random_weights, weights_app
from lipstream.errors import LipStreamError


@weights_app.command("download")
def weights_download(models: ModelsOpt = None,
                     force: Annotated[bool, typer.Option(help="Download again even if present.")] = False,
                     model: Annotated[str, typer.Option(
                         help="musetalk: musetalkV15/, sd-vae/, whisper/ and dwpose/ (compile's face tracker); "
                              "keysync: keysync/ (its checkpoints, HuBERT, the SVD VAE: accept that gated "
                              "repository's licence on Hugging Face and log in first).")] = "musetalk") -> None:
    """Fetch a model's files from Hugging Face into the models folder."""
    from lipstream.cli.checks import one_of
    from lipstream.models.download import MODEL_FILES, download
    from lipstream.models.layout import models_dir

    one_of("--model", model, tuple(MODEL_FILES))
    root = models_dir(models)
    fetched = download(root, force=force, report=lambda s: err.print(s), files=MODEL_FILES[model])
    out.print(f"{len(fetched)} files downloaded; models folder: {root}")


@weights_app.command("verify")
def weights_verify(models: ModelsOpt = None,
                   sha256: Annotated[bool, typer.Option(help="Also hash whole files (slow for unet.pth).")] = False
                   ) -> None:
    """Load every file of a models folder strictly and print what it holds."""
    from lipstream.models.verify import verify

    report = verify(models, sha256=sha256)
    out.print(f"models folder {report.root}")
    for row in report.rows:
        colour = {"ok": "green", "absent": "yellow"}.get(row.status, "red")
        out.print(f"[bold]{row.component:8}[/] [{colour}]{row.status}[/]  {row.file}  {row.size}  {row.format}",
                  highlight=False)
        if row.status == "ok":
            out.print(f"         {row.tensors} tensors, {row.parameters} parameters, {row.dtype}, "
                      f"fingerprint {row.fingerprint}", highlight=False)
        if row.detail:
            out.print(f"         {row.detail}", highlight=False, soft_wrap=True)
    if not report.ok:
        raise LipStreamError(f"{report.failures} of {len(report.rows)} components failed to load: {report.root}")


@weights_app.command("random")
def weights_random(folder: Annotated[Path, typer.Argument(help="Folder to write (upstream layout).")],
                   size: Annotated[str, typer.Option(help="full or tiny")] = "tiny",
                   seed: int = 0) -> None:
    """Write seeded random weights in the upstream layout (to test loading; NOT a real model)."""
    from lipstream.models.export import write_random_checkpoint

    warn_random_weights()
    write_random_checkpoint(folder, size=size, seed=seed)
    out.print(f"wrote random {size} weights to {folder}")
