"""Does this machine's torch load an AOTInductor package? A tiny module built with each link variant, loaded in a child.

Variants: `default` (torch's own link line) and `stdcxx` (the wrapper linked against the process's
libstdc++, `-l:libstdc++.so.6`, what engine/aot_build.py does on Linux). For each: the build time, the
child's exit status (a negative one is the signal that killed it) and facts about the wrapper library:
which libstdc++ it loads, and whether it holds its own copy of the locale facet ids (a static libstdc++).

    python3 benchmarks/aot_loader.py build cuda default stdcxx > aot.json
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile

import torch

VARIANTS = {"default": {}, "stdcxx": {"aot_inductor.custom_op_libs": [":libstdc++.so.6"]}}


def build(variant: str, device: str, folder: str) -> tuple[str, float]:
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).to(device).eval()
    program = torch.export.export(module, (torch.randn(4, 64, device=device),))
    path = os.path.join(folder, f"{variant}-{device}.pt2")
    t = time.perf_counter()
    torch._inductor.aoti_compile_and_package(program, package_path=path, inductor_configs=VARIANTS[variant])
    return path, time.perf_counter() - t


def facts(path: str) -> dict:
    unpacked = path + ".x"
    zipfile.ZipFile(path).extractall(unpacked)
    out = {}
    for so in glob.glob(unpacked + "/**/*.so", recursive=True):
        ldd = subprocess.run(["ldd", so], capture_output=True, text=True).stdout
        nm = subprocess.run(["nm", "-C", so], capture_output=True, text=True).stdout.splitlines()
        out[os.path.basename(so)] = {
            "ldd_stdcxx": [line.strip() for line in ldd.splitlines() if "stdc++" in line],
            "own_collate_id": [line for line in nm if "collate<char>::id" in line and " U " not in line][:3],
            "own_locale_symbols": sum(1 for line in nm if "std::locale::" in line and " U " not in line)}
    return out


def main() -> None:
    if sys.argv[1] == "load":  # the child
        from torch._inductor.package import load_package

        runner = load_package(sys.argv[2], run_single_threaded=True)
        print("loaded, output", tuple(runner(torch.randn(4, 64, device=sys.argv[3])).shape))
        return
    device, results = sys.argv[2], {}
    folder = tempfile.mkdtemp(prefix="aot-loader-")
    for variant in sys.argv[3:]:
        try:
            path, seconds = build(variant, device, folder)
        except Exception as e:  # noqa: BLE001  (reported, the next variant goes on)
            results[variant] = {"build_error": f"{type(e).__name__}: {str(e)[:400]}"}
            continue
        child = subprocess.run([sys.executable, __file__, "load", path, device], capture_output=True, text=True,
                               timeout=300)
        results[variant] = {"build_s": round(seconds, 1), "load_rc": child.returncode,
                            "load_output": (child.stdout + child.stderr)[-600:], "wrapper": facts(path), "path": path}
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
