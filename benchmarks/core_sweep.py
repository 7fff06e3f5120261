"""Which compile / layout / batch makes the GPU core fastest: `python benchmarks/core_sweep.py --track T`.

Each variant builds a fresh Engine (warm-up = compile + capture, timed), then measures the GPU
core (engine.render: gathers, UNet, VAE decode, blend; no encode) and the network step alone.
Also: faces of the compiled step against eager fp32 (PSNR), an end-to-end monologue with the
first variant's engine (pipeline check), and max-autotune of the VAE decoder in a subprocess
with a time limit. Results go to $OUT/core_sweep.json as they come.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from lipstream.avatar import compile_avatar, load_avatar, ping_pong  # noqa: E402
from lipstream.engine import Engine, FrameRequest  # noqa: E402
from lipstream.fixtures import speech_like, write_audio  # noqa: E402
from lipstream.fixtures.avatar import action_loop  # noqa: E402
from lipstream.models import load_musetalk  # noqa: E402
from lipstream.render import render_program  # noqa: E402
from lipstream.script import single_scene  # noqa: E402

WORK = Path("/tmp/lipstream-sweep")


def timed_fps(fn, frames: int, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return frames * repeats / (time.perf_counter() - t)


def measure(engine: Engine, slot: int, batch: int) -> dict:
    n = engine.avatars[slot].num_frames
    windows = torch.randn(512, 50, 384, device=engine.device)
    requests = [FrameRequest(slot, ping_pong(i, n), windows[i]) for i in range(512)]

    def core() -> None:
        for start in range(0, 512, batch):
            engine.render(requests[start:start + batch])

    net = engine._net_graph(batch)
    return {"core_fps": timed_fps(core, 512, 2), "network_fps": timed_fps(net.replay, batch, 40)}


def variant(m, avatar_dir: Path, name: str, batch: int, report: dict, out: Path, **kw) -> Engine:
    t = time.perf_counter()
    engine = Engine(m, batch, buckets=kw.pop("buckets", (batch,)), **kw)
    slot = engine.add_avatar(load_avatar(avatar_dir, "cuda"))
    engine.warm_up()
    torch.cuda.synchronize()
    row = {"name": name, "batch": batch, "warmup_s": time.perf_counter() - t, **measure(engine, slot, batch),
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
    report["variants"].append(row)
    print(row, flush=True)
    (out / "core_sweep.json").write_text(json.dumps(report, indent=2))
    return engine


def layout(m, channels_last: bool) -> None:
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    m.vae.decoder.to(memory_format=fmt)
    m.unet.to(memory_format=fmt)


def drop(*engines) -> None:
    del engines
    gc.collect()
    torch.cuda.empty_cache()


def autotune_child(args) -> None:
    """Runs in a subprocess: the VAE decoder alone under max-autotune (may be killed by the timeout)."""
    m = load_musetalk(random_weights=True, size="full", device="cuda", seed=0, warn=False)
    if args.channels_last:
        layout(m, True)
    t = time.perf_counter()
    engine = Engine(m, args.batch, compile="vae", autotune=True, channels_last=args.channels_last)
    net = engine._net_graph(args.batch)
    torch.cuda.synchronize()
    row = {"name": f"vae max-autotune{' CL' if args.channels_last else ''}", "batch": args.batch,
           "warmup_s": time.perf_counter() - t, "network_fps": timed_fps(net.replay, args.batch, 40)}
    print(json.dumps(row), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--track", type=Path)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--autotune-child", action="store_true")
    ap.add_argument("--channels-last", action="store_true")
    ap.add_argument("--autotune-timeout", type=int, default=200)
    args = ap.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/lipstream-inductor")
    if args.autotune_child:
        return autotune_child(args)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0),
              "commit": os.environ.get("LIPSTREAM_COMMIT", "unknown"), "variants": [], "monologue": []}
    loop = WORK / "anchor.mp4"
    action_loop(loop, width=1920, height=1080, seconds=10.0, fps=25, seed=0)
    m = load_musetalk(random_weights=True, size="full", device="cuda", seed=0)
    compile_avatar(loop, WORK / "avatars", m.vae, m.fingerprints["vae"], track_file=args.track, force=True,
                   progress=False)
    avatar_dir = WORK / "avatars" / "anchor"
    b = args.batch

    def monologue(e: Engine, name: str, batch: int, configs) -> None:
        mono = write_audio(WORK / "monologue.wav", speech_like(775 / 30, 16000, seed=3), 16000)
        program = single_scene("anchor", mono)
        for encoders, threads in configs:
            os.environ["LIPSTREAM_X264_THREADS"] = str(threads)
            for attempt in range(2):
                r = render_program(program, WORK / "mono.mp4", m, avatars_dir=WORK / "avatars", fps=30,
                                   batch_size=batch, encoders=encoders, preset="ultrafast", engine=e, progress=False)
            row = {"engine": name, "batch": batch, "encoders": encoders, "x264_threads": threads, "frames": r.frames,
                   "wall_s": r.wall_s, "fps": r.render_fps, "first_packet_s": r.first_frame_s, **r.timings}
            report["monologue"].append(row)
            print("monologue", row, flush=True)
            (out / "core_sweep.json").write_text(json.dumps(report, indent=2))
        os.environ.pop("LIPSTREAM_X264_THREADS")

    # the whole step compiled, with the renderer's buckets; end to end with it
    e = variant(m, avatar_dir, "compile all", b, report, out, compile="all", buckets=(8, b))
    monologue(e, "compile all", b, ((6, 2), (8, 2), (5, 3)))
    g = torch.Generator(device="cuda").manual_seed(0)
    lat = load_avatar(avatar_dir, "cuda", with_frames=False).latents[:b].half()
    win = torch.randn(b, 50, 384, device="cuda", generator=g)
    fast = e.faces(lat, win).float()
    drop(e)
    e = variant(m, avatar_dir, "compile all", 64, report, out, compile="all", buckets=(8, 64))
    monologue(e, "compile all", 64, ((6, 2),))
    drop(e)
    # faces of the compiled step against eager fp32, same inputs
    ref = copy.copy(m)
    ref.unet, ref.vae, ref.dtype = copy.deepcopy(m.unet).float(), copy.deepcopy(m.vae).float(), torch.float32
    want = Engine(ref, b, graphs=False).faces(lat.float(), win)
    del ref
    mse = ((fast - want) ** 2).flatten(1).mean(1)
    report["psnr_compile_all_faces_db"] = min(10 * math.log10(1 / max(float(x), 1e-12)) for x in mse)
    print("psnr", report["psnr_compile_all_faces_db"], flush=True)

    # channels_last (a fresh compile: dynamo does not guard on parameter layout)
    torch._dynamo.reset()
    layout(m, True)
    drop(variant(m, avatar_dir, "compile all CL", b, report, out, compile="all"))
    drop(variant(m, avatar_dir, "compile all CL", 64, report, out, compile="all"))
    best = max(report["variants"], key=lambda r: r["core_fps"])
    cl = best["name"].endswith("CL")
    if not cl:
        torch._dynamo.reset()
        layout(m, False)
    torch.backends.cudnn.benchmark = True
    e = variant(m, avatar_dir, best["name"] + " cudnn.benchmark", best["batch"], report, out, compile="all")
    fast = e.faces(lat, win).float()
    mse = ((fast - want) ** 2).flatten(1).mean(1)
    report["psnr_best_faces_db"] = min(10 * math.log10(1 / max(float(x), 1e-12)) for x in mse)
    (out / "core_sweep.json").write_text(json.dumps(report, indent=2))
    drop(e)
    torch.backends.cudnn.benchmark = False
    b = best["batch"]

    # 5. max-autotune of the VAE decoder, time-limited
    cmd = [sys.executable, __file__, "--autotune-child", "--batch", str(b)] + (["--channels-last"] if cl else [])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.autotune_timeout)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        report["autotune"] = json.loads(lines[-1]) if lines else {"error": done.stderr[-2000:]}
    except subprocess.TimeoutExpired:
        report["autotune"] = {"error": f"not done after {args.autotune_timeout} s"}
    print("autotune", report["autotune"], flush=True)
    (out / "core_sweep.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
