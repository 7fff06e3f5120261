"""Where loading an AOTInductor package spends its time (issue 28: 57 s for three packages on the H200).

    python benchmarks/aot_load_probe.py CACHE_ROOT   # LIPSTREAM_CACHE of a built cache
Per package: the archive's entries by kind, the checksum, the loader (a stack dump every 4 s while it
runs), the constants hand-over and the first call's absence (not timed here)."""

from __future__ import annotations

import collections
import faulthandler
import hashlib
import json
import os
import sys
import time
import zipfile
from pathlib import Path

import torch
from torch._inductor.package import load_package

root = Path(sys.argv[1]) / "aot"
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
t = time.perf_counter()
torch.empty(1, device=device)
print(f"torch {torch.__version__}, {device} ready in {time.perf_counter() - t:.2f} s", flush=True)
print("CUDA_CACHE_*:", {k: v for k, v in os.environ.items() if k.startswith("CUDA")}, flush=True)
for folder in sorted((root / "packages").glob("*")):
    pt2 = folder / "step.pt2"
    with zipfile.ZipFile(pt2) as z:
        kinds = collections.Counter()
        sizes = collections.Counter()
        for info in z.infolist():
            ext = Path(info.filename).suffix or Path(info.filename).name
            kinds[ext] += 1
            sizes[ext] += info.file_size
    print(folder.name, dict(kinds), {k: round(v / 2**20, 1) for k, v in sizes.items()}, flush=True)
    t = time.perf_counter()
    hashlib.sha256(pt2.read_bytes()).hexdigest()
    t1 = time.perf_counter()
    faulthandler.dump_traceback_later(4, repeat=True, file=sys.stdout)
    runner = load_package(str(pt2), run_single_threaded=True, device_index=0 if device.type == "cuda" else -1)
    faulthandler.cancel_dump_traceback_later()
    t2 = time.perf_counter()
    print(f"  sha256 {t1 - t:.2f} s, load_package {t2 - t1:.2f} s, constants {len(runner.get_constant_fqns())}",
          flush=True)
    t = time.perf_counter()
    runner2 = load_package(str(pt2), run_single_threaded=True, device_index=0 if device.type == "cuda" else -1)
    print(f"  the same package again: {time.perf_counter() - t:.2f} s", flush=True)
    meta = json.loads((folder / "meta.json").read_text())
    print("  meta:", {k: meta.get(k) for k in ("kind", "build_s", "torch", "format")}, flush=True)
