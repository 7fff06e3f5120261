"""Where loading an AOTInductor package spends its time (issue 28: 57 s for three packages on the H200).

    python benchmarks/aot_load_probe.py CACHE_ROOT [OUT_DIR]   # LIPSTREAM_CACHE of a built cache
Per package: the archive's entries by kind, then a child process that loads it twice (wall and CPU
seconds of each, the constants hand-over), run under `py-spy record --native` when py-spy is on the
PATH: the loading thread's frames with the most samples (inclusive and leaf) are printed. Then the
smallest package again with CUDA_MODULE_LOADING=EAGER and with TMPDIR=/dev/shm (where the loader
extracts the archive), to tell kernel loading and extraction apart."""

from __future__ import annotations

import collections
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path


def _cpu() -> float:
    """CPU seconds of this process and of the children it has waited for."""
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)))


def child(folder: Path) -> None:
    """Load one package as a render does (weights from its weights file), twice."""
    import torch
    from safetensors.torch import load_file
    from torch._inductor.package import load_package

    t = time.perf_counter()
    torch.empty(1, device="cuda" if torch.cuda.is_available() else "cpu")
    index = 0 if torch.cuda.is_available() else -1
    print(f"  torch {torch.__version__} ready in {time.perf_counter() - t:.2f} s", flush=True)
    meta = json.loads((folder / "meta.json").read_text())
    weights_dir = folder.parents[1] / "weights"
    weights = {}
    for w in sorted(weights_dir.glob("*.safetensors")):
        weights = load_file(str(w), device="cuda" if index == 0 else "cpu")
        break
    for attempt in ("first", "again"):
        t, c = time.perf_counter(), _cpu()
        runner = load_package(str(folder / "step.pt2"), run_single_threaded=True, device_index=index)
        t1, c1 = time.perf_counter(), _cpu()
        constants = {fqn: weights[name] for fqn, name in meta["constants"].items()
                     if fqn in set(runner.get_constant_fqns()) and name in weights}
        if constants:
            runner.load_constants(constants, check_full_update=False, user_managed=True)
        t2 = time.perf_counter()
        print(f"  load_package {attempt}: {t1 - t:.2f} s wall, {c1 - c:.2f} s CPU; constants "
              f"{len(constants)} handed over in {t2 - t1:.3f} s", flush=True)


def summarize(raw: Path, top: int = 25) -> None:
    """py-spy's raw (collapsed) stacks: the loading thread's heaviest frames."""
    inclusive: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit() or ("load_package" not in stack and "AOTI" not in stack):
            continue
        frames = [re.sub(r" \(.*?\)$", "", f) for f in stack.split(";")]
        n = int(count)
        total += n
        for f in set(frames):
            inclusive[f] += n
        leaf[frames[-1]] += n
    print(f"  py-spy: {total} samples in the loading thread", flush=True)
    for f, n in inclusive.most_common(top):
        print(f"    {100 * n / max(total, 1):5.1f}%  {f[:150]}")
    print("  leaves:")
    for f, n in leaf.most_common(12):
        print(f"    {100 * n / max(total, 1):5.1f}%  {f[:150]}")


def run_child(folder: Path, out: Path, tag: str, env: dict[str, str] | None = None, spy: bool = True) -> None:
    cmd = [sys.executable, __file__, "--child", str(folder)]
    raw = out / f"spy_{tag}.txt"
    pyspy = shutil.which("py-spy")
    if spy and pyspy:
        cmd = [pyspy, "record", "--native", "--idle", "--threads", "-r", "40", "-f", "raw", "-o", str(raw), "--"] + cmd
    t = time.perf_counter()
    p = subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=300)
    print(p.stdout, end="", flush=True)
    if p.returncode:
        print(f"  child rc {p.returncode}: {p.stderr[-800:]}", flush=True)
    print(f"  child process {time.perf_counter() - t:.1f} s", flush=True)
    if raw.exists():
        summarize(raw)


def main() -> None:
    if sys.argv[1] == "--child":
        child(Path(sys.argv[2]))
        return
    root = Path(sys.argv[1]) / "aot"
    out = Path(sys.argv[2] if len(sys.argv) > 2 else os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    print("CUDA_*:", {k: v for k, v in os.environ.items() if k.startswith("CUDA")}, "py-spy:", shutil.which("py-spy"),
          flush=True)
    folders = sorted((root / "packages").glob("*"), key=lambda f: (f / "step.pt2").stat().st_size)
    for folder in folders:
        pt2 = folder / "step.pt2"
        with zipfile.ZipFile(pt2) as z:
            kinds: collections.Counter[str] = collections.Counter()
            sizes: collections.Counter[str] = collections.Counter()
            for info in z.infolist():
                ext = Path(info.filename).suffix or Path(info.filename).name
                kinds[ext] += 1
                sizes[ext] += info.file_size
        print(f"{folder.name}: {pt2.stat().st_size / 2**20:.1f} MB", dict(kinds),
              {k: round(v / 2**20, 1) for k, v in sizes.items()}, flush=True)
        run_child(folder, out, folder.name.split("-")[0])
    if folders:
        small = folders[0]
        print(f"{small.name} with CUDA_MODULE_LOADING=EAGER:", flush=True)
        run_child(small, out, "eager", {"CUDA_MODULE_LOADING": "EAGER"}, spy=False)
        print(f"{small.name} with TMPDIR=/dev/shm:", flush=True)
        run_child(small, out, "shm", {"TMPDIR": "/dev/shm"}, spy=False)


if __name__ == "__main__":
    main()
