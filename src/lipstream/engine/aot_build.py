"""Building the compiled engine (`lipstream warmup`): export, AOTInductor, a check in a child process.

This is the half of engine/aot.py that needs the networks' modules and torch.export; a render only
loads what this wrote.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lipstream.engine.aot import (
    BUILD_ORDER,
    CHECK_FILE,
    EXTRA_FILE,
    FORMAT,
    KINDS,
    MAX_BATCH,
    META_FILE,
    PACKAGE_FILE,
    StepOptions,
    UNSUPPORTED_FILE,
    _folder_bytes,
    _machine_id,
    _package_ok,
    _sha256,
    aot_dir,
    architecture,
    default_options,
    device_info,
    package_key,
    prune,
    unsupported,
    weights_key,
)
from lipstream.models.config import AUDIO_DIM, MEL_FRAMES, N_MELS
from lipstream.engine.options import UPSAMPLE_MODES

if TYPE_CHECKING:
    from lipstream.models import MuseTalk

log = logging.getLogger(__name__)


@dataclass
class Built:
    kind: str
    path: Path
    status: str  # "built", "cached", "failed"
    seconds: float = 0.0
    bytes: int = 0
    message: str = ""


def _named_tensors(module: torch.nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    out = {f"{prefix}{k}": v for k, v in module.named_parameters(remove_duplicate=False)}
    out.update({f"{prefix}{k}": v for k, v in module.named_buffers(remove_duplicate=False)})
    return out


def _identity(t: torch.Tensor) -> tuple:
    return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype)


def _steps_for_export(models: MuseTalk, options: StepOptions) -> dict[str, torch.nn.Module]:
    from lipstream.engine.engines import net_steps

    steps = net_steps(models, options.upsample, options.decode_row, options.decode_stats)
    out: dict[str, torch.nn.Module] = {"full": steps[False], "crop": steps[True]}
    if models.whisper is not None:
        out["whisper"] = models.whisper
    return out


def _canonical(modules: dict[str, torch.nn.Module], upsample: str) -> dict[str, torch.Tensor]:
    """One name per tensor the steps read: the full step's names, then the Whisper encoder's.

    The upsamplers' folds of other modes are left out: an engine of another mode in this process folded them
    onto the shared modules, and the weights file would depend on what else the process ran."""
    other_folds = {f"folded_{mode}" for mode in UPSAMPLE_MODES if mode != upsample}
    named = _named_tensors(modules["full"], "step.")
    if "whisper" in modules:
        named.update(_named_tensors(modules["whisper"], "whisper."))
    seen: dict[tuple, str] = {}
    out = {}
    for name, t in named.items():
        if name.rsplit(".", 1)[-1] in other_folds:
            continue
        ident = _identity(t)
        if ident not in seen:
            seen[ident] = name
            out[name] = t
    return out


def _example_inputs(kind: str, device: torch.device, dtype: torch.dtype, batch: int = 4) -> tuple[torch.Tensor, ...]:
    if kind == "whisper":  # random, not silence: a package is checked on these (a constant input proves little)
        return (torch.randn(1, N_MELS, MEL_FRAMES, device=device, dtype=dtype),)
    return (torch.randn(batch, 8, 32, 32, device=device, dtype=dtype),
            torch.randn(batch, 50, AUDIO_DIM, device=device, dtype=dtype))


def _export(kind: str, module: torch.nn.Module, device: torch.device, dtype: torch.dtype):
    from torch.export import Dim

    inputs = _example_inputs(kind, device, dtype)
    shapes = None
    if kind != "whisper":
        batch = Dim("batch", min=1, max=MAX_BATCH)
        shapes = {"latents": {0: batch}, "windows": {0: batch}}
    with torch.no_grad():
        return torch.export.export(module, inputs, dynamic_shapes=shapes, strict=False)


def build_package(kind: str, module: torch.nn.Module, canonical: dict[str, torch.Tensor], target: Path,
                  key_fields: dict[str, Any], device: torch.device, dtype: torch.dtype,
                  weights: Path) -> tuple[Path, int]:
    """Export `module`, compile it with AOTInductor (weights left out), check it in a child process,
    and move the package folder into place (atomically: a folder that is there is complete).

    Nothing is loaded in this process: on some builds loading a package crashes the process
    (torch 2.11 on the H200 image), so a child loads it, runs it on the inputs in check.safetensors
    and compares with what the module gave. A child killed by a signal raises LoaderCrashed.
    """
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    program = _export(kind, module, device, dtype)
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        torch._inductor.aoti_compile_and_package(
            program, package_path=str(work / PACKAGE_FILE), inductor_configs=inductor_configs())
        by_identity = {_identity(t): name for name, t in canonical.items()}
        constants: dict[str, str] = {}
        extra: dict[str, torch.Tensor] = {}
        for fqn, t in {**program.state_dict, **program.constants}.items():
            name = by_identity.get(_identity(t)) if isinstance(t, torch.Tensor) else None
            if name is None:  # a tensor only this package reads (made while tracing): kept beside it
                name = f"{kind}.{fqn}"
                extra[name] = t.detach().contiguous().cpu()
            constants[fqn] = name
        if extra:
            save_file(extra, str(work / EXTRA_FILE))
        inputs = _example_inputs(kind, device, dtype)
        with torch.inference_mode():
            expected = module(*inputs)
        save_file({**{f"input{i}": x.cpu().contiguous() for i, x in enumerate(inputs)},
                   "expected": expected.cpu().contiguous()},
                  str(work / CHECK_FILE))
        meta = {"format": FORMAT, "kind": kind, "key": key_fields, "constants": constants,
                "built": time.strftime("%Y-%m-%dT%H:%M:%S"), "build_s": round(time.perf_counter() - t0, 1),
                "sha256": _sha256(work / PACKAGE_FILE)}
        (work / META_FILE).write_text(json.dumps(meta, indent=1))
        check = _check_in_child(work, weights, device)
        meta["check"] = check
        (work / META_FILE).write_text(json.dumps(meta, indent=1))
        if check.get("signal"):
            raise LoaderCrashed(f"loading an AOTInductor package killed the process (signal {check['signal']}) "
                                f"on torch {torch.__version__}")
        if not check.get("ok"):
            raise RuntimeError(f"the compiled {kind} step does not match the module: {check.get('message')}")
        if target.exists():  # another build got there first, or a broken one is being replaced
            shutil.rmtree(target, ignore_errors=True)
        os.replace(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return target, _folder_bytes(target)


def inductor_configs() -> dict[str, Any]:
    """How AOTInductor builds a package: the weights left out (they are handed in at load), and on Linux the
    package's wrapper linked against the C++ runtime the process has loaded (`-l:libstdc++.so.6`).

    Why the link: on the H200 image (torch 2.11) loading any package crashed in the wrapper's first
    std::regex (AOTInductorModel -> parse_device_str -> regex_traits::transform_primary, a bad virtual
    call), the pattern of two copies of libstdc++'s locale code in one process, each with its own facet
    ids. torch links libstdc++ explicitly only in Meta's own builds (cpp_builder._get_libstdcxx_args);
    naming the very library the process runs makes the wrapper use its facets."""
    configs: dict[str, Any] = {"aot_inductor.package_constants_in_so": False}
    if platform.system() == "Linux":
        configs["aot_inductor.custom_op_libs"] = [":libstdc++.so.6"]
    return configs


class LoaderCrashed(RuntimeError):
    """This machine's torch cannot load AOTInductor packages at all (its loader dies)."""


def _check_in_child(folder: Path, weights: Path, device: torch.device) -> dict[str, Any]:
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "lipstream.engine.aot", "check", str(folder), str(weights), str(device)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode < 0:
        return {"ok": False, "signal": -p.returncode, "message": p.stderr[-500:]}
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"ok": False, "message": f"exit {p.returncode}: {p.stderr[-500:]}"}


def _save_weights(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
    from lipstream.files import save_safetensors_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors_atomic(path, tensors, metadata)
    return path.stat().st_size


def _weights_names(path: Path) -> set[str] | None:
    if not path.exists():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            return set(f.keys())
    except Exception:  # noqa: BLE001  (unreadable: rewrite it)
        return None


def _mark_unsupported(info: dict[str, Any], reason: str, root: Path | None, clear: bool = False) -> None:
    from lipstream.files import atomic_path

    path = aot_dir(root) / UNSUPPORTED_FILE
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    if clear:
        if entries.pop(_machine_id(info), None) is None:
            return
    else:
        entries[_machine_id(info)] = {"reason": reason, "device": info, "when": time.strftime("%Y-%m-%d %H:%M")}
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(entries, indent=1))


def build_all(models: MuseTalk, source: dict[str, Any], kinds: Iterable[str] = KINDS,
              options: StepOptions | None = None, *, root: Path | None = None, force: bool = False,
              report: Callable[[Built], None] | None = None) -> list[Built]:
    """Build the weights file and every package of `kinds` that is missing (or all, with `force`).

    A kind that fails to build is reported as failed (renders fall back for it); the others go
    on, unless loading crashed the checking process: then no package can work with this torch,
    the machine is marked so (renders stop trying), and the rest are skipped.
    """
    device = models.device
    options = options or default_options(device)
    if getattr(torch, options.dtype) != models.dtype:
        raise ValueError(f"the networks are {models.dtype}, the options say {options.dtype}")
    info = device_info(device)
    base = aot_dir(root)
    modules = _steps_for_export(models, options)
    canonical = _canonical(modules, options.upsample)
    results: list[Built] = []

    def done(b: Built) -> None:
        results.append(b)
        if report:
            report(b)

    if force:
        _mark_unsupported(info, "", root, clear=True)
    crashed = unsupported(info, root)
    wpath = base / "weights" / f"{weights_key(source, options)}.safetensors"
    t0 = time.perf_counter()
    wanted = {**canonical, "mel_filters": torch.from_numpy(
        np.asarray(models.mel_filters, dtype=np.float32))}
    names = _weights_names(wpath)
    if crashed:
        done(Built("weights", wpath, "failed", message=f"skipped: {crashed}"))
    elif force or names is None or not set(wanted) <= names:
        meta = {"format": str(FORMAT), "source": json.dumps(source, sort_keys=True), "config": models.config.name,
                "random_weights": str(bool(models.random_weights)), "origin": models.source,
                "fingerprints": json.dumps(models.fingerprints, sort_keys=True)}
        size = _save_weights(wpath, wanted, meta)
        done(Built("weights", wpath, "built", time.perf_counter() - t0, size))
    else:
        done(Built("weights", wpath, "cached", bytes=wpath.stat().st_size))
    for kind in sorted(kinds, key=BUILD_ORDER.index):
        if kind not in modules:
            continue
        target = base / "packages" / package_key(kind, models.config, options, info)
        if crashed:
            done(Built(kind, target, "failed", message=f"skipped: {crashed}"))
            continue
        if not force and _package_ok(target):
            done(Built(kind, target, "cached", bytes=_folder_bytes(target)))
            continue
        t0 = time.perf_counter()
        key_fields = {"arch": architecture(models.config, kind), "options": options.for_kind(kind), "device": info}
        try:
            path, size = build_package(kind, modules[kind], canonical, target, key_fields, device, models.dtype,
                                       wpath)
            done(Built(kind, path, "built", time.perf_counter() - t0, size))
        except LoaderCrashed as e:
            crashed = f"{e} (checked by `lipstream warmup`; renders use the uncompiled engine)"
            _mark_unsupported(info, crashed, root)
            wpath.unlink(missing_ok=True)  # of no use on this machine (1.9 GB for the full-size networks)
            done(Built(kind, target, "failed", time.perf_counter() - t0, message=str(e)))
        except Exception as e:  # noqa: BLE001  (a compiler failure must not stop the others)
            log.warning("building the %s package failed: %s", kind, e)
            done(Built(kind, target, "failed", time.perf_counter() - t0, message=f"{type(e).__name__}: {e}"[:300]))
    prune(base)
    return results


def _target(models: MuseTalk, kind: str, options: StepOptions, root: Path | None = None) -> Path:
    return aot_dir(root) / "packages" / package_key(kind, models.config, options, device_info(models.device))


def missing_kinds(models: MuseTalk, kinds: Iterable[str], options: StepOptions | None = None, *,
                  root: Path | None = None, force: bool = False) -> list[str]:
    """The kinds of `kinds` (in build order) whose package is not built yet (all of them, with `force`)."""
    options = options or default_options(models.device)
    wanted = [k for k in sorted(set(kinds), key=BUILD_ORDER.index) if k != "whisper" or models.whisper is not None]
    return [k for k in wanted if force or not _package_ok(_target(models, k, options, root))]


def default_parallel(missing: int) -> int:
    """Processes for `missing` packages: $LIPSTREAM_WARMUP_JOBS, else one per 5 cores (16 cores: 3, all the
    kinds at once; 2 cores: 1, one after the other)."""
    jobs = os.environ.get("LIPSTREAM_WARMUP_JOBS", "").strip()
    limit = int(jobs) if jobs.isdigit() and int(jobs) > 0 else (os.cpu_count() or 1) // 5
    return max(1, min(missing, limit))


def build_in_children(models: MuseTalk, kinds: list[str], child_command: Callable[[str], list[str]], parallel: int,
                      *, root: Path | None = None, report: Callable[[Built], None] | None = None) -> list[Built]:
    """Build each of `kinds` in a process of its own, `parallel` at a time (the weights file is written).

    `child_command(kind)` starts a process that loads the same networks, builds that one package as
    build_all does and prints what it built as Built's fields in JSON, last (engine/networks.py's `build` entry);
    Inductor's compile workers are shared out between the children. A child that dies is reported as that
    kind failing; the others go on."""
    import subprocess

    options = default_options(models.device)
    for kind in kinds:  # `force`: the old package goes now (a child builds only what is missing)
        target = _target(models, kind, options, root)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, (os.cpu_count() or 1) // parallel))}
    if root is not None:
        env["LIPSTREAM_CACHE"] = str(root)
    results: list[Built] = []
    queue = list(kinds)
    running: dict[str, tuple[subprocess.Popen, float]] = {}
    while queue or running:
        while queue and len(running) < parallel:
            kind = queue.pop(0)
            running[kind] = (subprocess.Popen(child_command(kind), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env),
                             time.perf_counter())
        time.sleep(0.2)
        for kind, (p, t0) in list(running.items()):
            if p.poll() is None:
                continue
            del running[kind]
            stdout, stderr = p.communicate()
            try:
                b = Built(**{**json.loads(stdout.strip().splitlines()[-1]), "kind": kind})
                b.path = Path(b.path)
            except (ValueError, IndexError, TypeError):
                b = Built(kind, _target(models, kind, options, root), "failed", time.perf_counter() - t0,
                          message=f"its build process exited {p.returncode}: {stderr.strip()[-300:]}")
            results.append(b)
            if report:
                report(b)
    return results
