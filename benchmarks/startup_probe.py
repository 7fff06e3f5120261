"""Where a one-shot render's fixed costs go on this machine (issue 28): the pieces, each alone, fresh processes.

    python benchmarks/startup_probe.py [--runs 2] [--x264-procs 1,8,16]   # writes JSON lines, a table last

- cpu: the processor, cores and threads per core (lscpu).
- memory: first touch of 1 GiB of anonymous memory and of a 1 GiB shared-memory file (a fresh arena), a copy
  of 775 1080p I420 frames into it (the render's consumer), a second pass over touched pages.
- pinned: the render's ring of host buffers (6 x 32 1080p frames, pinned) allocated in a fresh process.
- x264: ultrafast crf 18 on moving 1080p frames, one encoder with 1 and 2 threads, then N single-threaded
  encoder processes at once (the segment encoders' ceiling on these cores).
- cuda: a fresh process's `import torch`, then the device: cuInit and the primary context (torch.zeros),
  the first fp16 matmul (cuBLAS) and conv (cuDNN); and the same with the primary context made on a thread
  through the driver API while torch imports (lipstream.cuda_early).
- weights: a 1.87 GiB fp16 safetensors file (the compiled engine's size, ~700 tensors) onto the GPU in a
  fresh process, the page cache warm: safetensors' load_file(device="cuda") against models/staged.py.
- conv_shapes: in one process, the first run of each of 24 UNet-like conv shapes at batch 8, then the same at
  batch 32, then again (cuDNN's per-shape set-up: is it what a graph capture of a new bucket pays?).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

W, H = 1920, 1080
FRAME = H * 3 // 2 * W


def emit(row: dict) -> None:
    print(json.dumps(row), flush=True)


def cpu() -> None:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        keep = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "Socket(s)", "CPU MHz", "L3")
        emit({"probe": "cpu", **{k.strip(): v.strip() for k, v in (l.split(":", 1) for l in text.splitlines() if ":" in l)
                                 if k.strip().startswith(keep)}})
    except OSError:
        emit({"probe": "cpu", "model": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0]})


def memory() -> None:
    t = time.perf_counter()
    a = np.empty(1 << 30, np.uint8)
    a.fill(1)
    first = time.perf_counter() - t
    del a
    t = time.perf_counter()
    a = np.empty(1 << 30, np.uint8)
    a.fill(1)
    again = time.perf_counter() - t
    del a
    frame = np.full(FRAME, 7, np.uint8)
    slots = (1 << 30) // FRAME
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as f:
        os.ftruncate(f.fileno(), slots * FRAME)
        m = mmap.mmap(f.fileno(), slots * FRAME)
        arena = np.frombuffer(m, np.uint8).reshape(slots, FRAME)
        t = time.perf_counter()
        for i in range(775):
            np.copyto(arena[i % slots], frame)
        copy = time.perf_counter() - t
        t = time.perf_counter()
        for i in range(775):
            np.copyto(arena[i % slots], frame)
        copy2 = time.perf_counter() - t
        del arena
        m.close()
    emit({"probe": "memory", "anon_1gib_first_touch_s": round(first, 3), "anon_1gib_again_s": round(again, 3),
          "shm_arena_775_frames_first_s": round(copy, 3), "shm_arena_775_frames_touched_s": round(copy2, 3),
          "slots": slots})


def pinned() -> None:
    code = ("import time; t=time.perf_counter(); import torch; torch.zeros(1, device='cuda'); t1=time.perf_counter();"
            "r=[torch.empty((32, 1620, 1920), dtype=torch.uint8, pin_memory=True) for _ in range(6)];"
            "t2=time.perf_counter(); print(round(t1-t,3), round(t2-t1,3))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    parts = out.stdout.split()
    emit({"probe": "pinned_ring", "torch_and_context_s": float(parts[0]) if parts else None,
          "ring_6x32_frames_s": float(parts[1]) if len(parts) > 1 else None, "err": out.stderr[-300:]})


def x264_child(threads: int, frames_n: int) -> None:
    import av
    from encoders_alone import frames

    pics = frames(60)
    ctx = av.CodecContext.create("libx264", "w")
    ctx.width, ctx.height, ctx.pix_fmt = W, H, "yuv420p"
    ctx.time_base = Fraction(1, 30)
    ctx.options = {"crf": "18", "preset": "ultrafast"}
    ctx.thread_count = threads
    ctx.open()
    t, c = time.perf_counter(), time.process_time()
    size = 0
    for i in range(frames_n):
        f = av.VideoFrame.from_ndarray(pics[i % len(pics)], format="yuv420p")
        f.pts = i
        size += sum(p.size for p in ctx.encode(f))
    size += sum(p.size for p in ctx.encode(None))
    print(json.dumps({"wall": time.perf_counter() - t, "cpu": time.process_time() - c, "kb": size / frames_n / 1e3}))


def x264(procs: list[int], frames_n: int) -> None:
    me = [sys.executable, __file__, "--x264-child"]
    for threads in (1, 2):
        r = json.loads(subprocess.run([*me, str(threads), str(frames_n)], capture_output=True, text=True).stdout)
        emit({"probe": "x264_one", "threads": threads, "ms_per_frame": round(r["wall"] / frames_n * 1e3, 2),
              "cpu_per_frame_ms": round(r["cpu"] / frames_n * 1e3, 2), "kB_per_frame": round(r["kb"])})
    for n in procs:
        t = time.perf_counter()
        ps = [subprocess.Popen([*me, "1", str(frames_n)], stdout=subprocess.PIPE, text=True) for _ in range(n)]
        rs = [json.loads(p.communicate()[0]) for p in ps]
        wall = time.perf_counter() - t
        emit({"probe": "x264_parallel", "processes": n, "threads_each": 1, "fps_total": round(n * frames_n / wall, 1),
              "ms_per_frame_each": round(sum(r["wall"] for r in rs) / n / frames_n * 1e3, 2)})


CUDA_CHILD = r"""
import sys, time, json
t0 = time.perf_counter()
early = sys.argv[1] == "early"
if early:
    sys.path.insert(0, sys.argv[2])
    from lipstream.cuda_early import start_primary_context
    handle = start_primary_context()
t = time.perf_counter()
import torch
t_import = time.perf_counter() - t
t = time.perf_counter(); torch.cuda.is_available(); t_avail = time.perf_counter() - t
t = time.perf_counter(); torch.zeros(1, device="cuda"); torch.cuda.synchronize(); t_ctx = time.perf_counter() - t
a = torch.randn(1024, 1024, device="cuda", dtype=torch.float16)
t = time.perf_counter(); (a @ a).sum().item(); t_mm = time.perf_counter() - t
x = torch.randn(8, 320, 32, 32, device="cuda", dtype=torch.float16)
w = torch.randn(320, 320, 3, 3, device="cuda", dtype=torch.float16)
t = time.perf_counter(); torch.nn.functional.conv2d(x, w, padding=1).sum().item(); t_conv = time.perf_counter() - t
x = torch.randn(8, 128, 256, 256, device="cuda", dtype=torch.float16)
w = torch.randn(128, 128, 3, 3, device="cuda", dtype=torch.float16)
t = time.perf_counter(); torch.nn.functional.conv2d(x, w, padding=1).sum().item(); t_conv2 = time.perf_counter() - t
print(json.dumps({"import_torch_s": round(t_import, 3), "is_available_s": round(t_avail, 3),
                  "context_s": round(t_ctx, 3), "first_matmul_s": round(t_mm, 3), "first_conv_s": round(t_conv, 3),
                  "second_conv_shape_s": round(t_conv2, 3), "to_context_ready_s": round(t_import + t_avail + t_ctx, 3),
                  "early_made": bool(early and handle.wait(5.0)), "total_s": round(time.perf_counter() - t0, 3)}))
"""


def cuda(runs: int) -> None:
    for r in range(runs):
        for mode in ("plain", "early"):
            t = time.perf_counter()
            p = subprocess.run([sys.executable, "-c", CUDA_CHILD, mode, str(ROOT / "src")], capture_output=True, text=True)
            wall = time.perf_counter() - t
            try:
                row = json.loads(p.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                row = {"err": p.stderr[-500:]}
            emit({"probe": "cuda_start", "mode": mode, "run": r, "process_wall_s": round(wall, 3), **row})


WEIGHTS_CHILD = r"""
import sys, time, json
sys.path.insert(0, sys.argv[3])
import torch
torch.zeros(1, device="cuda")
t = time.perf_counter()
if sys.argv[1] == "load_file":
    from safetensors.torch import load_file
    w = load_file(sys.argv[2], device="cuda:0")
else:
    from lipstream.models.staged import load_to_device
    w = load_to_device(sys.argv[2], torch.device("cuda:0"))
torch.cuda.synchronize()
print(json.dumps({"seconds": round(time.perf_counter() - t, 3), "tensors": len(w),
                  "gib": round(sum(v.numel() * v.element_size() for v in w.values()) / 2**30, 3)}))
"""


def weights(runs: int) -> None:
    import torch
    from safetensors.torch import save_file

    path = Path(tempfile.mkdtemp(prefix="lipstream-probe-")) / "weights.safetensors"
    g = torch.Generator().manual_seed(0)
    shapes = ([(1280, 1280, 3, 3), (640, 640, 3, 3), (320, 320, 3, 3), (1280, 768), (5120, 1280), (1280,)] * 36
              + [(320,), (640,), (1280, 320)] * 160)  # 696 tensors, 1.92 GiB
    tensors = {f"t{i}": torch.empty(s, dtype=torch.float16).uniform_(-1, 1, generator=g) for i, s in enumerate(shapes)}
    save_file(tensors, str(path))
    del tensors
    try:
        for r in range(runs):
            for mode in ("load_file", "staged"):
                t = time.perf_counter()
                p = subprocess.run([sys.executable, "-c", WEIGHTS_CHILD, mode, str(path), str(ROOT / "src")],
                                   capture_output=True, text=True)
                try:
                    row = json.loads(p.stdout.strip().splitlines()[-1])
                except (ValueError, IndexError):
                    row = {"err": p.stderr[-500:]}
                emit({"probe": "weights", "mode": mode, "run": r, "process_wall_s": round(time.perf_counter() - t, 3), **row})
    finally:
        path.unlink()
        path.parent.rmdir()


CONV_CHILD = r"""
import time, json
import torch
torch.zeros(1, device="cuda")
shapes = [(c, s, k) for c, s in ((320, 32), (640, 16), (1280, 8), (1280, 4), (512, 64), (256, 128), (128, 256),
                                   (4, 32)) for k in (1, 3, 3)]
out = {}
for batch in (8, 32, 8):
    times = []
    for i, (c, s, k) in enumerate(shapes):
        x = torch.randn(batch, c, s, s, device="cuda", dtype=torch.float16)
        w = torch.randn(c + i, c, k, k, device="cuda", dtype=torch.float16)  # + i: 24 distinct shapes
        torch.cuda.synchronize()
        t = time.perf_counter()
        torch.nn.functional.conv2d(x, w, padding=k // 2)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    key = f"batch{batch}" + ("_again" if f"batch{batch}" in out else "")
    out[key] = {"total_s": round(sum(times), 3), "first_s": round(times[0], 3), "max_s": round(max(times), 3)}
print(json.dumps(out))
"""


def conv_shapes(runs: int) -> None:
    for r in range(runs):
        p = subprocess.run([sys.executable, "-c", CONV_CHILD], capture_output=True, text=True)
        try:
            row = json.loads(p.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            row = {"err": p.stderr[-500:]}
        emit({"probe": "conv_shapes", "run": r, **row})


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--x264-child":
        x264_child(int(sys.argv[2]), int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--x264-procs", default="1,8,16")
    ap.add_argument("--x264-frames", type=int, default=90)
    ap.add_argument("--skip", default="", help="probes to leave out, comma-separated")
    args = ap.parse_args()
    skip = set(args.skip.split(","))
    for name, fn in (("cpu", cpu), ("memory", memory),
                     ("x264", lambda: x264([int(n) for n in args.x264_procs.split(",")], args.x264_frames)),
                     ("pinned", pinned), ("cuda", lambda: cuda(args.runs)), ("weights", lambda: weights(args.runs)),
                     ("conv_shapes", lambda: conv_shapes(args.runs))):
        if name not in skip:
            fn()


if __name__ == "__main__":
    main()
