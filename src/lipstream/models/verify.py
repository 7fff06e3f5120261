"""Check a models folder: load each component strictly and describe what is there."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from lipstream.errors import LipStreamError
from lipstream.models import load
from lipstream.models.checkpoint import file_sha256, read_json, read_state_dict
from lipstream.models.layout import DWPOSE_FILE, UNET_DIR, VAE_DIR, WHISPER_DIR, find, models_dir

WEIGHT_FILES = {"unet": f"{UNET_DIR}/unet.pth", "vae": f"{VAE_DIR}/diffusion_pytorch_model.safetensors",
                "whisper": f"{WHISPER_DIR}/model.safetensors", "dwpose": DWPOSE_FILE.path}
OPTIONAL = {"dwpose": "compile's face tracker (render and serve run without it): `lipstream weights download` "
                      "fetches it"}


@dataclass
class Row:
    component: str
    file: str = "-"
    size: str = "-"
    format: str = "-"
    tensors: str = "-"
    parameters: str = "-"
    dtype: str = "-"
    fingerprint: str = "-"
    status: str = "ok"
    detail: str = ""

    def cells(self) -> list[str]:
        return [self.component, self.file, self.size, self.format, self.tensors, self.parameters, self.dtype,
                self.fingerprint, self.status]


@dataclass
class Report:
    root: Path
    rows: list[Row] = field(default_factory=list)

    @property
    def failures(self) -> int:
        return sum(r.status not in ("ok", "absent") for r in self.rows)

    @property
    def ok(self) -> bool:
        return self.failures == 0


def verify(models: str | Path | None = None, *, sha256: bool = False) -> Report:
    """Load unet, vae, whisper and DWPose one by one; a failure is recorded in its row, not raised. DWPose
    missing is said, not failed: only compile needs it, and only without --track."""
    root = models_dir(models)
    report = Report(root)
    loaders = {"unet": lambda: load.load_unet(root, read_json(root / UNET_DIR / "musetalk.json")),
               "vae": lambda: load.load_vae(root, read_json(root / VAE_DIR / "config.json")),
               "whisper": lambda: (load.check_preprocessor(root),
                                   load.load_whisper_encoder(root, read_json(root / WHISPER_DIR / "config.json")))[1],
               "dwpose": lambda: _dwpose(path)}
    for name, rel in WEIGHT_FILES.items():
        row = Row(name)
        report.rows.append(row)
        path = find(root, rel)
        if path is None:
            row.status = "absent" if name in OPTIONAL else "missing"
            row.detail = load.missing_message(root, rel) + (f": {OPTIONAL[name]}" if name in OPTIONAL else "")
            continue
        row.file = str(path.relative_to(root))
        row.size = f"{path.stat().st_size / 2**20:.1f} MiB"
        row.format = ("safetensors" if path.suffix == ".safetensors" else
                      "mmengine (restricted unpickler)" if name == "dwpose" else "torch (weights_only)")
        try:
            sd = read_state_dict(path, restricted=name == "dwpose")  # an mmengine checkpoint: not weights_only
            row.tensors = str(len(sd))
            row.dtype = ",".join(sorted({str(t.dtype).removeprefix("torch.") for t in sd.values()}))
            net, row.fingerprint = loaders[name]()
            row.parameters = f"{sum(p.numel() for p in net.parameters()) / 1e6:.2f} M"
            shapes = _key_shapes(net)
            row.detail = shapes + (f"; sha256 {file_sha256(path)}" if sha256 else "")
        except LipStreamError as e:
            row.status, row.detail = "FAILED", str(e)
    return report


def _dwpose(path: Path) -> tuple[torch.nn.Module, str]:
    from lipstream.models.checkpoint import fingerprint

    net = load.load_dwpose(path)
    return net, fingerprint(net.state_dict())


def _key_shapes(net: torch.nn.Module) -> str:
    sd = net.state_dict()
    keys = [k for k in ("conv_in.weight", "conv_out.weight", "decoder.conv_out.weight", "embed_positions.weight",
                        "conv1.weight", "backbone.stem.0.conv.weight", "head.cls_x.weight") if k in sd]
    return ", ".join(f"{k} {list(sd[k].shape)}" for k in keys)
