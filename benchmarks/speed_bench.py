"""Speed variants on the GPU, in one run: `python benchmarks/speed_bench.py --track T --out DIR`.

GPU core (engine.render: windows -> UNet -> VAE decode -> blend, no encode) for eager, CUDA
graphs, and graphs + compiled VAE decoder; end to end for the 25.8 s / 774-frame 30 fps 1080p
monologue with one or several x264 encoders; PSNR of the fastest path against the reference.
Results are appended to DIR/speed.json as they come, so a timeout keeps what finished.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import av  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from lipstream.avatar import compile_avatar, load_avatar, ping_pong  # noqa: E402
from lipstream.engine import Engine, FrameRequest  # noqa: E402
from lipstream.fixtures import speech_like, write_audio  # noqa: E402
from lipstream.fixtures.avatar import action_loop  # noqa: E402
from lipstream.models import load_musetalk  # noqa: E402
from lipstream.render import render_program  # noqa: E402
from lipstream.script import single_scene  # noqa: E402
from lipstream.media.mp4 import MP4Writer  # noqa: E402
from fractions import Fraction  # noqa: E402


def save(out: Path, report: dict) -> None:
    (out / "speed.json").write_text(json.dumps(report, indent=2))


def core_fps(engine: Engine, avatar_dir: Path, batch: int, frames: int) -> float:
    slot = engine.add_avatar(load_avatar(avatar_dir, engine.device))
    n = engine.avatars[slot].num_frames
    windows = torch.randn(frames, 50, 384, device=engine.device)
    requests = [FrameRequest(slot, ping_pong(i, n), windows[i]) for i in range(frames)]
    engine.warm_up()
    engine.render(requests[:batch])
    torch.cuda.synchronize()
    t = time.perf_counter()
    for start in range(0, frames, batch):
        engine.render(requests[start:start + batch])
    torch.cuda.synchronize()
    return frames / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--track", type=Path)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed monologue renders per config (after one warm-up)")
    ap.add_argument("--quick", action="store_true", help="only the compiled engine; skip the PSNR check")
    ap.add_argument("--minimal", action="store_true", help="--quick, no encoder-only runs, one monologue config")
    ap.add_argument("--final", action="store_true",
                    help="the issue's numbers: compiled engine only, two encoder configs, PSNR, peak memory")
    args = ap.parse_args()
    args.minimal = args.minimal or args.final
    args.quick = args.quick or args.minimal
    out, work = args.out, Path("/tmp/lipstream-speed")
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    report: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0),
                    "commit": os.environ.get("LIPSTREAM_COMMIT", "unknown"), "batch": args.batch,
                    "cpus": os.cpu_count(), "core_fps": {}, "monologue": []}
    loop = work / "anchor.mp4"
    action_loop(loop, width=1920, height=1080, seconds=10.0, fps=25, seed=0)
    t = time.perf_counter()
    m = load_musetalk(random_weights=True, size="full", device="cuda", seed=0)
    torch.cuda.synchronize()
    report["model_build_s"] = time.perf_counter() - t  # random weights; a real checkpoint: BENCHMARKS.md
    compile_avatar(loop, work / "avatars", m.vae, m.fingerprints["vae"], track_file=args.track, force=True,
                   progress=False)
    avatar_dir = work / "avatars" / "anchor"

    engines = {}
    cache = Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/lipstream-inductor"))
    report["inductor_cache_warm"] = cache.is_dir() and any(cache.iterdir())
    variants = (("graphs+compile", {"compile": "all"}),) if args.quick else (
        ("eager", {"graphs": False}), ("graphs", {}), ("graphs+compile vae", {"compile": "vae"}),
        ("graphs+compile", {"compile": "all"}))
    for name, kw in variants:
        t = time.perf_counter()
        engine = Engine(m, args.batch, buckets=(8, args.batch), **kw)
        fps = core_fps(engine, avatar_dir, args.batch, 512)
        report["core_fps"][name] = {"fps": fps, "setup_and_warmup_s": time.perf_counter() - t - 512 / fps}
        print(f"GPU core {name}: {fps:.0f} fps", report["core_fps"][name], flush=True)
        save(out, report)
        engines[name] = engine

    # the encoder alone: 774 real 1080p frames from memory, no GPU work
    frames = load_avatar(avatar_dir).frames.numpy()
    silence = np.zeros(int(25.8 * 48000), np.float32)
    report["encode_only"] = []
    for encoders, processes, segment, preset in (() if args.minimal else ((8, False, 32, "ultrafast"),
                                                                         (8, False, 32, "veryfast"),
                                                                         (8, False, 64, "veryfast"))):
        t = time.perf_counter()
        with MP4Writer(work / "enc.mp4", 1920, 1080, Fraction(30), silence, preset=preset, encoders=encoders,
                       processes=processes, segment=segment) as writer:
            t = time.perf_counter()  # pool start excluded (once per process)
            for i in range(774):
                writer.write(frames[ping_pong(i, len(frames))])
        row = {"encoders": encoders, "processes": processes, "segment": segment, "preset": preset,
               "fps": 774 / (time.perf_counter() - t)}
        report["encode_only"].append(row)
        print("encode only", row, flush=True)
        save(out, report)

    mono = write_audio(work / "monologue.wav", speech_like(775 / 30, 16000, seed=3), 16000)
    program = single_scene("anchor", mono)
    configs = [("graphs+compile", 8, False, 32, "ultrafast", 1), ("graphs+compile", 6, False, 32, "ultrafast", 2),
               ("graphs+compile", 4, False, 32, "ultrafast", 3), ("graphs+compile", 8, False, 32, "veryfast", 1),
               ("graphs+compile", 12, False, 32, "ultrafast", 1)]
    if args.minimal:
        configs = configs[1:2]
    if args.final:
        configs = [configs[0][:1] + (6, False, 32, "ultrafast", 2), configs[0][:1] + (8, False, 32, "ultrafast", 2)]
    if not args.quick:
        configs = [("graphs+compile", 1, False, 32, "veryfast", 16), ("graphs+compile", 8, False, 32, "ultrafast", 2)] + configs
    for name, encoders, processes, segment, preset, threads in configs:
        os.environ["LIPSTREAM_X264_THREADS"] = str(threads)
        for attempt in range(1 + args.repeats):  # the first is a warm-up (encoder pool, avatar graphs)
            torch.cuda.reset_peak_memory_stats()
            r = render_program(program, work / "mono.mp4", m, avatars_dir=work / "avatars", fps=30, batch_size=args.batch,
                               encoders=encoders, encoder_processes=processes, segment_frames=segment, preset=preset,
                               engine=engines[name], progress=False)
            if attempt == 0:
                continue
            row = {"engine": name, "encoders": encoders, "x264_threads": threads, "processes": processes,
                   "segment": segment, "preset": preset, "frames": r.frames, "wall_s": r.wall_s, "fps": r.render_fps,
                   "first_packet_s": r.first_frame_s, **r.timings, "bytes": (work / "mono.mp4").stat().st_size,
                   "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30}
            report["monologue"].append(row)
            print("monologue", row, flush=True)
            save(out, report)
    if args.quick and not args.final:
        report["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        save(out, report)
        return

    speech = write_audio(work / "s2.wav", speech_like(2.0, 16000, seed=2), 16000)
    p2 = single_scene("anchor", speech)
    render_program(p2, work / "fast.mp4", m, avatars_dir=work / "avatars", crf=0, engine=engines["graphs+compile"],
                   progress=False)
    ref = load_musetalk(random_weights=True, size="full", device="cuda", dtype=torch.float32, seed=0, warn=False)
    render_program(p2, work / "ref.mp4", ref, avatars_dir=work / "avatars", crf=0, reference=True, progress=False)
    avatar = load_avatar(avatar_dir)
    values = []
    with av.open(str(work / "fast.mp4")) as a, av.open(str(work / "ref.mp4")) as b:
        for j, (x, y) in enumerate(zip(a.decode(video=0), b.decode(video=0))):
            x1, y1, x2, y2 = avatar.boxes[ping_pong(j, avatar.num_frames)].tolist()
            d = x.to_ndarray()[y1:y2, x1:x2].astype(float) - y.to_ndarray()[y1:y2, x1:x2].astype(float)
            values.append(10 * math.log10(255 ** 2 / max(np.mean(d ** 2), 1e-12)))
    report["psnr_graphs_compile_vs_reference_db"] = {"min": min(values), "mean": float(np.mean(values))}
    report["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print("PSNR", report["psnr_graphs_compile_vs_reference_db"], flush=True)
    save(out, report)


if __name__ == "__main__":
    main()
