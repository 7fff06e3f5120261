"""The reference for models/dwpose.py: mmdet 3.1.0's CSPNeXt and mmpose 1.1.0's RTMCCBlock and ScaleNorm,
the very files MuseTalk's config builds DWPose from, run without importing the mmdet or mmpose packages
(those need mmcv's compiled ops, xtcocotools, numpy<2...).

Needs `mmengine` and `mmcv` importable (mmcv-lite 2.0.x is enough: only mmcv.cnn is used). The .py files
are read from, in this order:
- $LIPSTREAM_DWPOSE_REFERENCE: a folder holding the two wheels as `pip download --no-deps mmdet==3.1.0
  mmpose==1.1.0` leaves them, or their unpacked trees (folders `mmdet/` and `mmpose/`);
- else the installed mmdet / mmpose distributions, located by their metadata (not imported).
`reference_modules()` returns None where none of these holds them.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
import types
import zipfile
from pathlib import Path

ENV_VAR = "LIPSTREAM_DWPOSE_REFERENCE"

# Executed in this order, under these module names (the files import each other by them).
FILES = (
    ("mmdet.utils.typing_utils", "mmdet/utils/typing_utils.py"),
    ("mmdet.models.layers.se_layer", "mmdet/models/layers/se_layer.py"),
    ("mmdet.models.layers.csp_layer", "mmdet/models/layers/csp_layer.py"),
    ("mmdet.models.backbones.csp_darknet", "mmdet/models/backbones/csp_darknet.py"),
    ("mmdet.models.backbones.cspnext", "mmdet/models/backbones/cspnext.py"),
    ("mmpose.models.utils.rtmcc_block", "mmpose/models/utils/rtmcc_block.py"),
)
PACKAGES = ("mmdet", "mmdet.registry", "mmdet.utils", "mmdet.models", "mmdet.models.layers",
            "mmdet.models.backbones", "mmpose", "mmpose.models", "mmpose.models.utils")


def _reader(rel_paths: list[str]):
    """A function rel -> (source text, where it came from), or None if some file is found nowhere."""
    folder = os.environ.get(ENV_VAR)
    if folder:
        root = Path(folder)
        wheels = sorted(root.glob("mmdet-3.1.0-*.whl")) + sorted(root.glob("mmpose-1.1.0-*.whl"))
        names = {}
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                names.update({n: wheel for n in z.namelist()})
        if all(rel in names or (root / rel).is_file() for rel in rel_paths):
            def read(rel: str) -> tuple[str, str]:
                if (root / rel).is_file():
                    return (root / rel).read_text(), str(root / rel)
                with zipfile.ZipFile(names[rel]) as z:
                    return z.read(rel).decode(), f"{names[rel]}!{rel}"
            return read
    try:
        dists = {"mmdet": importlib.metadata.distribution("mmdet"), "mmpose": importlib.metadata.distribution("mmpose")}
    except importlib.metadata.PackageNotFoundError:
        return None
    if dists["mmdet"].version != "3.1.0" or dists["mmpose"].version != "1.1.0":
        return None
    paths = {rel: Path(dists[rel.split("/")[0]].locate_file(rel)) for rel in rel_paths}
    if not all(p.is_file() for p in paths.values()):
        return None
    return lambda rel: (paths[rel].read_text(), str(paths[rel]))


def reference_modules() -> types.SimpleNamespace | None:
    """CSPNeXt, RTMCCBlock and ScaleNorm classes of the reference code, or None where its files are not found.

    The stand-in `mmdet.*` / `mmpose.*` packages live in sys.modules only while the files execute."""
    from mmengine.registry import Registry

    read = _reader([rel for _, rel in FILES])
    if read is None:
        return None
    saved = {name: sys.modules[name] for name in list(sys.modules) if name.split(".")[0] in ("mmdet", "mmpose")}
    for name in saved:
        del sys.modules[name]
    loaded = {}
    try:
        for name in PACKAGES:
            package = types.ModuleType(name)
            package.__path__ = []
            sys.modules[name] = package
        sys.modules["mmdet.registry"].MODELS = Registry("model")
        for name, rel in FILES:
            text, origin = read(rel)
            module = types.ModuleType(name)
            module.__file__ = origin
            module.__package__ = name.rpartition(".")[0]
            sys.modules[name] = module
            exec(compile(text, origin, "exec"), module.__dict__)
            loaded[name] = module
            if name == "mmdet.utils.typing_utils":  # `from mmdet.utils import ConfigType`
                vars(sys.modules["mmdet.utils"]).update({k: v for k, v in vars(module).items() if k[0] != "_"})
            if name == "mmdet.models.layers.csp_layer":  # `from ..layers import CSPLayer`
                sys.modules["mmdet.models.layers"].CSPLayer = module.CSPLayer
    finally:
        for name in [n for n in sys.modules if n.split(".")[0] in ("mmdet", "mmpose")]:
            del sys.modules[name]
        sys.modules.update(saved)
    block = loaded["mmpose.models.utils.rtmcc_block"]
    return types.SimpleNamespace(CSPNeXt=loaded["mmdet.models.backbones.cspnext"].CSPNeXt,
                                 RTMCCBlock=block.RTMCCBlock, ScaleNorm=block.ScaleNorm)


def reference_dwpose(ref: types.SimpleNamespace, config) -> "torch.nn.Module":  # noqa: F821
    """The reference network at `config`'s size: mmdet's CSPNeXt as MuseTalk's config builds it (P5, SyncBN,
    SiLU, channel attention) and RTMCCHead's forward composed of mmpose's parts (the class itself pulls in
    mmpose's codecs and metrics), under the checkpoint's names, in eval mode on the CPU."""
    import torch
    from torch import nn

    from lipstream.models.dwpose import INPUT_HEIGHT, INPUT_WIDTH, KEYPOINTS, SPLIT_RATIO, STRIDE

    full = (64, 128, 256, 512, 1024)
    widen = config.widths[-1] / full[-1]
    deepen = config.depths[1] / 6  # upstream's blocks per stage: max(round(n * deepen), 1), n = 3, 6, 6, 3
    backbone = ref.CSPNeXt(arch="P5", expand_ratio=0.5, deepen_factor=deepen, widen_factor=widen, out_indices=(4,),
                           channel_attention=True, norm_cfg=dict(type="SyncBN"), act_cfg=dict(type="SiLU"))
    tokens = (INPUT_WIDTH // STRIDE) * (INPUT_HEIGHT // STRIDE)

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.final_layer = nn.Conv2d(config.widths[-1], KEYPOINTS, config.kernel, padding=config.kernel // 2)
            self.mlp = nn.Sequential(ref.ScaleNorm(tokens), nn.Linear(tokens, config.hidden, bias=False))
            self.gau = ref.RTMCCBlock(KEYPOINTS, config.hidden, config.hidden, s=config.attention_dim,
                                      expansion_factor=config.expansion, dropout_rate=0.0, drop_path=0.0,
                                      attn_type="self-attn", act_fn="SiLU", use_rel_bias=False, pos_enc=False)
            self.cls_x = nn.Linear(config.hidden, INPUT_WIDTH * SPLIT_RATIO, bias=False)
            self.cls_y = nn.Linear(config.hidden, INPUT_HEIGHT * SPLIT_RATIO, bias=False)

        def forward(self, feats):
            x = self.gau(self.mlp(torch.flatten(self.final_layer(feats[-1]), 2)))
            return self.cls_x(x), self.cls_y(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.backbone = backbone
            self.head = Head()

        def forward(self, x):
            return self.head(self.backbone(x))

    return Net().eval()
