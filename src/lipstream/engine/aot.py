"""Ahead-of-time compiled network steps: torch.export + AOTInductor packages, cached on disk.

torch.compile traces and compiles in every process (about 20 s on the H200 even with a warm
Inductor cache). A package here is compiled once per machine and loads in a fraction of a
second: no dynamo, no Inductor.

Three kinds of package: the frame step with the whole decode ("full"), with the decode of the
face rows only ("crop", engine/decode.py), and the Whisper encoder ("whisper"). Each is keyed
by what its code depends on: the GPU (name and compute capability), torch and CUDA versions,
dtype, the engine options that change the graph, and the networks' architecture. Not by the
weights: they are not inside the package (that also avoids torch 2.11's crash loading a 1.7 GB
package). The weights live beside it, one safetensors file per checkpoint, holding exactly the
tensors the steps read (the fused upsamplers' folded weights included); they are mmapped straight
to the GPU and handed to the packages. So one package serves every checkpoint of its shape, and
real weights load as fast as random ones.

Layout under the cache folder ($LIPSTREAM_CACHE, default ~/.cache/lipstream):

    aot/packages/<kind>-<key>/step.pt2, meta.json
    aot/weights/<key>.safetensors

Everything there is safe to delete at any time; `lipstream warmup` builds it again
(engine/aot_build.py: the half that needs the networks' modules). The folder
is bounded ($LIPSTREAM_CACHE_GB, default 20): the least recently used entries go first. A package
that does not load (corrupt, truncated, built by another torch) is removed with a warning and
the caller falls back to the uncompiled engine; the next warmup rebuilds it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from lipstream.engine.options import DEFAULT_DECODE_ROW
from lipstream.models.config import ModelConfig


log = logging.getLogger(__name__)

FORMAT = 2  # bump when the package layout or the step's maths changes: every old entry is ignored
KINDS = ("crop", "full", "whisper")
STEP_KINDS = {"full": False, "crop": True}  # kind -> cropped decode
MAX_BATCH = 256  # the packages take any batch from 1 to this
DEFAULT_LIMIT_GB = 20.0
PACKAGE_FILE = "step.pt2"
META_FILE = "meta.json"
CHECK_FILE = "check.safetensors"  # inputs and the module's output: a package is checked against them
EXTRA_FILE = "extra.safetensors"  # tensors only that package reads (none normally)
UNSUPPORTED_FILE = "unsupported.json"  # machines whose torch crashes loading any package
CHECK_DB = 40.0  # a package must match its module to 40 dB (fp16 rounding gives about 60)
BUILD_ORDER = ("whisper", "crop", "full")  # the smallest first: it finds a broken loader soonest


def cache_root() -> Path:
    """The cache folder: $LIPSTREAM_CACHE or ~/.cache/lipstream (Inductor's kernels live there too)."""
    return Path(os.environ.get("LIPSTREAM_CACHE", "~/.cache/lipstream")).expanduser()


def aot_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / "aot"


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:20]


def device_info(device: torch.device) -> dict[str, Any]:
    """What compiled code depends on besides its source: the GPU architecture and the software."""
    info: dict[str, Any] = {"torch": torch.__version__, "type": device.type}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        info.update(name=torch.cuda.get_device_name(index), capability=list(torch.cuda.get_device_capability(index)),
                    cuda=torch.version.cuda)
    else:
        info.update(machine=platform.machine())
    return info


@dataclass(frozen=True)
class StepOptions:
    """The engine options a package's graph depends on (engine/engines.py documents them)."""

    dtype: str = "float16"
    upsample: str = "transpose"
    decode_row: int = DEFAULT_DECODE_ROW
    decode_stats: str = "rows"

    def for_kind(self, kind: str) -> dict[str, Any]:
        if kind == "whisper":
            return {"dtype": self.dtype}
        out = {"dtype": self.dtype, "upsample": self.upsample}
        if kind == "crop":
            out.update(decode_row=self.decode_row, decode_stats=self.decode_stats)
        return out


def default_options(device: torch.device) -> StepOptions:
    """The engine's defaults, in the dtype the networks run in on that device (fp16 on CUDA, fp32 elsewhere)."""
    return StepOptions(dtype="float16" if device.type == "cuda" else "float32")


def architecture(config: ModelConfig, kind: str) -> dict[str, Any]:
    """The network configs a kind's graph is built from (weights are inputs, not part of the key)."""
    public = lambda cfg: {k: v for k, v in cfg.items() if not k.startswith("_")}  # noqa: E731
    if kind == "whisper":
        return {"whisper": public(config.whisper)}
    return {"unet": public(config.unet), "vae": public(config.vae)}


def package_key(kind: str, config: ModelConfig, options: StepOptions, device: dict[str, Any]) -> str:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    return f"{kind}-" + _digest({"format": FORMAT, "kind": kind, "arch": architecture(config, kind),
                                 "options": options.for_kind(kind), "device": device})


def weights_key(source: dict[str, Any], options: StepOptions) -> str:
    """`source`: where the weights come from (random: size, seed and device type; a folder: its
    files' paths, sizes and modification times), plus what changes the stored tensors."""
    return _digest({"format": FORMAT, "source": source, "dtype": options.dtype, "upsample": options.upsample})


def random_source(size: str, seed: int, device: torch.device) -> dict[str, Any]:
    # Random weights are drawn on the device that runs them: a GPU's draw differs from a CPU's.
    return {"random": size, "seed": seed, "device": device.type}


def folder_source(files: Iterable[Path]) -> dict[str, Any]:
    out = {}
    for path in files:
        st = path.stat()
        out[str(path.resolve())] = [st.st_size, st.st_mtime_ns]
    return {"files": out}


# ---------------------------------------------------------------------------------------------
# The cache's state: which packages are usable here.

def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def check_package(folder: Path, weights: Path, device: torch.device) -> dict[str, Any]:
    """Load a package as a render does, run it on its check inputs: how close it is to the module."""
    from safetensors.torch import load_file

    step = _load_step(folder, load_file(str(weights), device=_device_str(device)), device, verify_hash=False)
    data = load_file(str(folder / CHECK_FILE), device=_device_str(device))
    inputs = [data[f"input{i}"] for i in range(sum(k.startswith("input") for k in data))]
    with torch.inference_mode():
        got = step(*inputs).float()
    want = data["expected"].float()
    rms = (got - want).pow(2).mean().sqrt().item()
    peak = max(want.abs().max().item(), 1e-12)
    db = 99.0 if rms == 0 else 20 * np.log10(peak / rms)
    return {"ok": bool(db >= CHECK_DB), "db": round(float(db), 1), "message": f"{db:.1f} dB against the module"}


def _package_ok(folder: Path) -> bool:
    """Complete, of this format, and it passed its check when it was built."""
    try:
        meta = json.loads((folder / META_FILE).read_text())
        return (meta.get("format") == FORMAT and bool(meta.get("check", {}).get("ok"))
                and (folder / PACKAGE_FILE).stat().st_size > 0)
    except (OSError, ValueError):
        return False


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _machine_id(info: dict[str, Any]) -> str:
    return _digest(info)


def unsupported(info: dict[str, Any], root: Path | None = None) -> str | None:
    """Why packages cannot be used with this GPU and torch (a loader that crashed), or None."""
    try:
        entries = json.loads((aot_dir(root) / UNSUPPORTED_FILE).read_text())
        return entries.get(_machine_id(info), {}).get("reason")
    except (OSError, ValueError, AttributeError):
        return None


# ---------------------------------------------------------------------------------------------
# Loading (every render): torch, safetensors and the packages; nothing else.

def _device_str(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"


def _load_runner(path: Path, device: torch.device) -> Any:
    """The package's model, loaded by torch's C++ loader directly.

    Not torch._inductor.package.load_package: before loading it compares the package's recorded CPU ISA
    with this machine's, which runs Inductor's ISA probes (a C++ compile and a child process per ISA).
    That was about 19 s per package on the H200 and only ever logs a warning; our package key already
    holds the GPU, torch and CUDA versions. It also imports all of Inductor."""
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else -1)
    # run_single_threaded: no per-call model pool and its events, so a CUDA graph can capture the call
    try:
        loader = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", True, 1, index)
    except TypeError:  # another torch's binding: its own Python loader, probes and all
        from torch._inductor.package import load_package

        return load_package(str(path), run_single_threaded=True, device_index=index)
    return PackageRunner(loader)


class PackageRunner:
    """A loaded package's model: tensors in, its output out (one tensor, or the exported structure)."""

    def __init__(self, loader: Any):
        self.loader = loader
        self._out_spec = pytree.treespec_loads(loader.get_call_spec()[1])  # once, not per call

    def __call__(self, *inputs: torch.Tensor) -> Any:
        outputs = self.loader.boxed_run(list(inputs))  # boxed: the loader may free the list's inputs early
        return outputs[0] if self._out_spec.is_leaf() else pytree.tree_unflatten(outputs, self._out_spec)

    def get_constant_fqns(self) -> list[str]:
        return self.loader.get_constant_fqns()

    def load_constants(self, constants: dict[str, torch.Tensor], *, check_full_update: bool,
                       user_managed: bool) -> None:
        self.loader.load_constants(constants, False, check_full_update, user_managed)


def _load_step(folder: Path, weights: dict[str, torch.Tensor], device: torch.device,
               verify_hash: bool = True) -> CompiledStep:
    """One package with its weights handed in (no copy: the runner reads the tensors in place)."""
    return _attach(_open_step(folder, device, verify_hash), weights, device)


def _open_step(folder: Path, device: torch.device, verify_hash: bool = True) -> tuple[Any, dict]:
    """A package's runner and its meta, checked against the checksum it was built with; no weights yet."""
    meta = json.loads((folder / META_FILE).read_text())
    if verify_hash and _sha256(folder / PACKAGE_FILE) != meta["sha256"]:
        raise ValueError("its file does not match the checksum it was built with")
    meta["folder"] = str(folder)
    return _load_runner(folder / PACKAGE_FILE, device), meta


def _attach(opened: tuple[Any, dict], weights: dict[str, torch.Tensor], device: torch.device) -> CompiledStep:
    """The weights handed to an opened package's runner (in place: it keeps raw pointers to them)."""
    from safetensors.torch import load_file

    runner, meta = opened
    extra = Path(meta["folder"]) / EXTRA_FILE
    if extra.exists():
        weights = {**weights, **load_file(str(extra), device=_device_str(device))}
    wanted = set(runner.get_constant_fqns())
    constants = {fqn: weights[name] for fqn, name in meta["constants"].items() if fqn in wanted}
    runner.load_constants(constants, check_full_update=True, user_managed=True)
    return CompiledStep(meta["kind"], runner, constants)


class CompiledStep:
    """A loaded package with its weights: call it like the module it was exported from."""

    def __init__(self, kind: str, runner: Any, constants: dict[str, torch.Tensor]):
        self.kind = kind
        self.runner = runner
        self.constants = constants  # kept alive here: the runner holds raw pointers to them

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.runner(*inputs)


@dataclass
class CompiledNetworks:
    """What the compiled engine and the renderer need, from packages instead of the networks' modules:
    the frame steps (PackageEngine runs them) and the Whisper encoder (audio.features.AudioNetworks)."""

    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    options: StepOptions
    steps: dict[bool, CompiledStep]  # cropped decode -> step
    whisper: CompiledStep | None
    mel_filters: np.ndarray  # [201, 80], what audio/features.py reads
    random_weights: bool
    source: str
    fingerprints: dict[str, str] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)

    def whisper_states(self, mel: torch.Tensor) -> torch.Tensor:
        """[S, 80, 3000] -> [S, 1500, 5, 384]: the package takes one 30 s segment per call."""
        if self.whisper is None:
            raise ValueError("these compiled packages hold no Whisper encoder")
        return torch.cat([self.whisper(mel[i:i + 1]) for i in range(mel.shape[0])])


class NotBuilt(Exception):
    """No usable package or weights file for this machine, options and checkpoint (yet)."""

    def __init__(self, message: str, buildable: bool = True):
        super().__init__(message)
        self.buildable = buildable  # False: this machine cannot use packages, a warmup would not help


def load_compiled(config: ModelConfig, source: dict[str, Any], device: torch.device,
                  options: StepOptions | None = None, kinds: Iterable[str] = KINDS, *,
                  root: Path | None = None) -> CompiledNetworks:
    """Load the packages of `kinds` and their weights; raises NotBuilt (with the reason) if any is missing.

    A package or weights file that exists but does not load is removed with a warning (so the
    next warmup builds it again) and reported as NotBuilt: the caller falls back, never crashes.
    """
    t0 = time.perf_counter()
    options = options or default_options(device)
    base = aot_dir(root)
    info = device_info(device)
    reason = unsupported(info, root)
    if reason:
        raise NotBuilt(f"the compiled engine does not work on this machine: {reason}", buildable=False)
    folders = {kind: base / "packages" / package_key(kind, config, options, info) for kind in kinds}
    missing = [k for k, f in folders.items() if not _package_ok(f)]
    wpath = base / "weights" / f"{weights_key(source, options)}.safetensors"
    if missing or not wpath.exists():
        what = ", ".join(missing + ([] if wpath.exists() else ["weights"]))
        raise NotBuilt(f"no compiled {what} for this GPU, torch {torch.__version__} and these networks")
    from concurrent.futures import ThreadPoolExecutor

    from lipstream.models.staged import load_with_metadata

    # the weights read on a thread (file reads and copies, outside the GIL) while the packages load here
    with ThreadPoolExecutor(1, thread_name_prefix="lipstream-weights") as pool:
        reading = pool.submit(load_with_metadata, wpath, torch.device(_device_str(device)))
        opened: dict[str, tuple[Any, dict]] = {}
        failed: tuple[str, Exception] | None = None  # the package that did not open (after the weights' verdict)
        for kind, folder in folders.items():
            try:
                opened[kind] = _open_step(folder, device)
            except Exception as e:  # noqa: BLE001
                failed = (kind, e)
                break
        t_packages = time.perf_counter() - t0
        try:
            meta, weights = reading.result()
        except Exception as e:  # noqa: BLE001
            _discard(wpath, f"the compiled engine's weights {wpath} do not load ({type(e).__name__}: {e})")
            raise NotBuilt(f"the weights file {wpath} was unreadable and is removed") from None
    t_weights = time.perf_counter()
    steps: dict[str, CompiledStep] = {}
    for kind, folder in folders.items():
        try:
            if failed is not None and failed[0] == kind:
                raise failed[1]
            steps[kind] = _attach(opened[kind], weights, device)
        except Exception as e:  # noqa: BLE001
            _discard(folder, f"the compiled {kind} package {folder} does not load ({type(e).__name__}: {e})")
            raise NotBuilt(f"the {kind} package was unusable and is removed") from None
        os.utime(folder)  # least recently used goes first when the cache is pruned
    os.utime(wpath)
    return CompiledNetworks(
        config=config, device=device, dtype=getattr(torch, options.dtype), options=options,
        steps={cropped: steps[k] for k, cropped in STEP_KINDS.items() if k in steps}, whisper=steps.get("whisper"),
        mel_filters=weights["mel_filters"].cpu().numpy(),
        random_weights=meta.get("random_weights") == "True", source=meta.get("origin", str(wpath)),
        fingerprints=json.loads(meta.get("fingerprints", "{}")),
        # weights_s: until they were on the device (the packages opened meanwhile, packages_open_s)
        timings={"weights_s": t_weights - t0, "packages_open_s": t_packages,
                 "packages_s": time.perf_counter() - t_weights})


def _discard(path: Path, message: str) -> None:
    log.warning("%s; removed: `lipstream warmup` builds it again", message)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def prune(base: Path | None = None, limit_gb: float | None = None) -> list[Path]:
    """Remove the least recently used packages and weights until the folder holds at most `limit_gb`."""
    base = base or aot_dir()
    if limit_gb is None:
        limit_gb = float(os.environ.get("LIPSTREAM_CACHE_GB", DEFAULT_LIMIT_GB))
    entries = [p for p in (base / "packages").glob("*") if p.is_dir()] + list((base / "weights").glob("*.safetensors"))
    sized = sorted(((p.stat().st_mtime, p, _folder_bytes(p) if p.is_dir() else p.stat().st_size) for p in entries),
                   key=lambda e: e[0])
    total = sum(s for _, _, s in sized)
    removed = []
    for _, path, size in sized:
        if total <= limit_gb * 2**30:
            break
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        total -= size
        removed.append(path)
    return removed


if __name__ == "__main__":  # python -m lipstream.engine.aot check FOLDER WEIGHTS DEVICE (the builder's child)
    import sys

    if len(sys.argv) != 5 or sys.argv[1] != "check":
        sys.exit("usage: python -m lipstream.engine.aot check PACKAGE_FOLDER WEIGHTS DEVICE")
    try:
        result = check_package(Path(sys.argv[2]), Path(sys.argv[3]), torch.device(sys.argv[4]))
    except Exception as e:  # noqa: BLE001  (reported to the builder, which decides)
        result = {"ok": False, "message": f"{type(e).__name__}: {e}"[:500]}
    print(json.dumps(result))
