"""Reading upstream weight files safely and loading them strictly, with one-line errors.

Only safetensors, `torch.load(..., weights_only=True)`, and for files that hold other objects (mmengine's
checkpoints: DWPose) a restricted unpickler that builds only tensors and plain containers: a checkpoint can
never run code.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import re
import types
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lipstream.errors import WeightsError
from lipstream.models.layout import HOW_TO_GET

StateDict = dict[str, torch.Tensor]


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: not a valid JSON config ({_short(e)}); {HOW_TO_GET}") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: expected a JSON object; {HOW_TO_GET}")
    return data


def read_restricted(path: Path) -> object:
    """A torch-saved file as it holds it (dicts, lists, tensors), read with `RESTRICTED_PICKLE`: every other
    object it names is skipped, none built, so no code in the file runs. For checkpoints that wrap their
    weights in training state (mmengine's, DeepSpeed's, fairseq's `cfg`)."""
    try:
        with warnings.catch_warnings():  # a corrupt file may look like an odd pickle protocol: we say it once
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=False, pickle_module=RESTRICTED_PICKLE)
    except Exception as e:  # corrupt, truncated or foreign files raise many different types
        raise WeightsError(f"{path}: cannot read weights ({_short(e)}): the file is corrupt or incomplete; "
                           f"{HOW_TO_GET}") from None


def read_state_dict(path: Path, *, restricted: bool = False) -> StateDict:
    """Tensors of a .safetensors or a torch-saved (.pth/.bin) state dict, on the CPU; a checkpoint that
    wraps them (`{'state_dict': ..., 'meta': ...}`) gives its 'state_dict'. `restricted`: read torch files
    with `RESTRICTED_PICKLE` instead of torch's weights-only loader, for files whose other entries hold
    objects that loader refuses (mmengine's message hub, numpy arrays): those are skipped."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(path), device="cpu")
        elif restricted:
            sd = read_restricted(path)
        else:
            with warnings.catch_warnings():  # a corrupt file may look like an odd pickle protocol: we say it once
                warnings.simplefilter("ignore")
                sd = torch.load(path, map_location="cpu", weights_only=True)  # no mmap: files may be replaced
    except WeightsError:
        raise
    except Exception as e:  # corrupt, truncated or foreign files raise many different types
        raise WeightsError(f"{path}: cannot read weights ({_short(e)}): the file is corrupt or incomplete; "
                           f"{HOW_TO_GET}") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not sd:
        raise WeightsError(f"{path}: not a state dict of tensors; {HOW_TO_GET}")
    other = next((k for k, v in sd.items() if not isinstance(v, torch.Tensor)), None)
    if other is not None:
        raise WeightsError(f"{path}: not a state dict of tensors ({other!r} is a {type(sd[other]).__name__}); "
                           f"{HOW_TO_GET}")
    return sd


class Skipped:
    """What the restricted unpickler builds for any class or function it does not allow: made from nothing,
    every call the unpickling makes on it ignored, so no code named in the file ever runs."""

    def __new__(cls, *args, **kwargs):
        return super().__new__(cls)

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        pass

    def __setitem__(self, key, value) -> None:
        pass

    def append(self, item) -> None:
        pass

    def extend(self, items) -> None:
        pass


_ALLOWED = {("collections", "OrderedDict"): OrderedDict,
            ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
            ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter}


class RestrictedUnpickler(pickle.Unpickler):
    """Builds tensors (torch's own rebuild functions; torch.load supplies the storages), OrderedDicts, dtypes
    and pickle's plain types; every other global becomes an inert `Skipped`."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        return Skipped


def _restricted_load(file, **kwargs):
    return RestrictedUnpickler(file, **kwargs).load()


# What torch.load takes as `pickle_module`: its Unpickler (which torch subclasses only to map storage
# names and read the storages from the archive) and `load` (legacy, non-zip files).
RESTRICTED_PICKLE = types.ModuleType("lipstream_restricted_pickle")
RESTRICTED_PICKLE.Unpickler = RestrictedUnpickler
RESTRICTED_PICKLE.load = _restricted_load


def load_strict(module: nn.Module, sd: StateDict, source: Path | str) -> None:
    """Load `sd` into `module` (possibly on the meta device) requiring every key and shape to match."""
    expected = module.state_dict()
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    wrong = [k for k in expected if k in sd and tuple(sd[k].shape) != tuple(expected[k].shape)]
    if missing or unexpected or wrong:
        parts = []
        if wrong:
            k = wrong[0]
            parts.append(f"{len(wrong)} tensors have other shapes (e.g. {k}: file {list(sd[k].shape)}, "
                         f"model {list(expected[k].shape)})")
        if missing:
            parts.append(f"{len(missing)} tensors missing (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensors (e.g. {unexpected[0]})")
        raise WeightsError(f"{source}: does not match its config: {'; '.join(parts)}; {HOW_TO_GET}")
    module.load_state_dict(sd, strict=True, assign=True)
    leftover = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if leftover:  # buffers the checkpoint does not hold and the constructor did not fill
        raise WeightsError(f"{source}: model has uninitialised tensors after loading ({leftover[0]})")


_OLD_ATTENTION = re.compile(r"^(.*\.attentions\.\d+)\.(query|key|value|proj_attn)\.(weight|bias)$")
_NEW_NAME = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}


def rename_old_vae_attention(sd: StateDict) -> StateDict:
    """sd-vae-ft-mse was saved by diffusers 0.4 with the old attention names; map them to today's."""
    out: StateDict = {}
    for k, v in sd.items():
        m = _OLD_ATTENTION.match(k)
        if m:
            k = f"{m.group(1)}.{_NEW_NAME[m.group(2)]}.{m.group(3)}"
            if v.ndim == 4:  # some conversions stored the projections as 1x1 convs
                v = v[:, :, 0, 0]
        out[k] = v
    return out


def fingerprint(sd: StateDict) -> str:
    """A short content hash: names, shapes and a strided sample of every tensor (fast on GBs).

    Stable across devices and dtype casts done after loading, so caches can record which weights
    made them.
    """
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name].detach()
        h.update(f"{name}:{tuple(t.shape)};".encode())
        flat = t.reshape(-1)
        step = max(1, flat.numel() // 256)
        sample = flat[::step][:256].to(device="cpu", dtype=torch.float32).contiguous()
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _short(e: BaseException) -> str:
    if "Weights only load failed" in str(e):
        return "not a PyTorch tensor checkpoint, or it holds objects that weights_only loading refuses"
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."
