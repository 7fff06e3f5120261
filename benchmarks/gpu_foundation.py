"""Foundation checks and timings on a CUDA GPU, in one run: `python benchmarks/gpu_foundation.py --out DIR`.

Measures audio decode + Whisper features + per-frame windows for a 60 s clip with full-size
random weights in fp16 (issue: < 35 ms after warm-up), checks the GPU path against CPU/fp32
references, and runs the full-size UNet + VAE decoder once as a sanity check. Writes
foundation.json and foundation.md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from lipstream.audio import as_fps, audio_windows, num_frames, prepare_speech  # noqa: E402
from lipstream.audio.decode import load_audio_tensor  # noqa: E402
from lipstream.audio.features import log_mel_segments, whisper_features  # noqa: E402
from lipstream.audio.resample import resample  # noqa: E402
from lipstream.fixtures import speech_like, write_audio  # noqa: E402
from lipstream.models import load_musetalk  # noqa: E402

DEV = "cuda"  # --smoke runs everything on the CPU with tiny models, to check the script itself
SIZE = "full"


def versions() -> dict:
    import av
    import diffusers
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, DEV: torch.version.cuda,
            "gpu": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu", "transformers": transformers.__version__,
            "diffusers": diffusers.__version__, "av": av.__version__, "cpus": os.cpu_count()}


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def stats(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"median": statistics.median(ms), "min": ms[0], "p90": ms[int(0.9 * (len(ms) - 1))], "n": len(ms)}


def time_speech(path: Path, fps, m, runs: int) -> dict:
    for _ in range(3):
        prepare_speech(path, fps, m.whisper, m.feature_extractor)
    stages: dict[str, list[float]] = {}
    for _ in range(runs):
        s = prepare_speech(path, fps, m.whisper, m.feature_extractor)
        for k, v in s.timings_ms.items():
            stages.setdefault(k, []).append(v)
    return {"frames": s.frames, "seconds": s.duration, **{k: stats(v) for k, v in stages.items()}}


def loop_windows(features: torch.Tensor, fps, frames: int) -> torch.Tensor:
    from fractions import Fraction
    import math

    from lipstream.audio.windows import LEFT_PAD_STEPS

    mult = Fraction(50) / as_fps(fps)
    z = torch.zeros(1, 5, 384, device=features.device, dtype=features.dtype)
    padded = torch.cat([z.repeat(LEFT_PAD_STEPS, 1, 1), features, z.repeat(math.ceil(mult) * 6 + 20, 1, 1)])
    return torch.stack([padded[math.floor(i * mult):math.floor(i * mult) + 10].reshape(50, 384)
                        for i in range(frames)])


def checks(m16, tmp: Path) -> dict:
    out = {}
    x = load_audio_tensor(tmp / "speech_44k_stereo.mp3", "cpu")
    xg = load_audio_tensor(tmp / "speech_44k_stereo.mp3", DEV)
    out["decode_resample_gpu_vs_cpu_max_abs"] = float((xg.cpu() - x).abs().max())
    fe = m16.feature_extractor
    mel_c = log_mel_segments(x, fe)
    mel_g = log_mel_segments(x.to(DEV), fe).cpu()
    out["log_mel_gpu_vs_cpu_max_abs"] = float((mel_c - mel_g).abs().max())
    m32 = load_musetalk(random_weights=True, size=SIZE, device=DEV, dtype=torch.float32, seed=0,
                        components=["whisper"])
    f16 = whisper_features(x.to(DEV), m16.whisper, fe).float()
    f32 = whisper_features(x.to(DEV), m32.whisper, fe)
    out["features_fp16_vs_fp32_rel_l2"] = float((f16 - f32).norm() / f32.norm())
    for fps in (25, 30, 29.97):
        frames = num_frames(x.numel(), fps)
        same = torch.equal(audio_windows(f16, fps, frames), loop_windows(f16, fps, frames))
        out[f"gather_equals_loop_{fps}fps"] = same
    sine = torch.sin(torch.arange(48000 * 2, device=DEV) * (2 * np.pi * 440 / 48000))
    r = resample(sine, 48000, 16000)
    ref = torch.sin(torch.arange(r.numel(), device=DEV) * (2 * np.pi * 440 / 16000))
    out["resample_sine_max_abs_err"] = float((r - ref)[200:-200].abs().max())
    return out


@torch.inference_mode()
def unet_vae_sanity(m, batch: int = 32, iters: int = 10) -> dict:
    g = torch.Generator(device=DEV).manual_seed(0)
    lat = torch.randn(batch, 8, 32, 32, device=DEV, dtype=torch.float16 if DEV == "cuda" else torch.float32, generator=g)
    aud = torch.randn(batch, 50, 384, device=DEV, dtype=torch.float16 if DEV == "cuda" else torch.float32, generator=g)

    def step():
        pred = m.unet(lat, 0, encoder_hidden_states=m.pe(aud)).sample
        return m.vae.decode(pred / 0.18215).sample

    for _ in range(3):
        img = step()
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        img = step()
    sync()
    dt = (time.perf_counter() - t) / iters
    return {"batch": batch, "ms_per_batch": dt * 1e3, "fps": batch / dt, "finite": bool(torch.isfinite(img).all()),
            "out_shape": list(img.shape)}


def full_checkpoint_load(tmp: Path) -> dict:
    """Write full-size random weights in the upstream layout, then time the real (strict) loader."""
    from lipstream.models.export import write_random_checkpoint

    t = time.perf_counter()
    root = write_random_checkpoint(tmp / "models", size=SIZE, seed=0, binary=True)
    written = time.perf_counter() - t
    sizes = {p.relative_to(root).as_posix(): p.stat().st_size for p in root.rglob("*") if p.is_file()}
    timings = []
    for _ in range(2):  # the second load has the files in the page cache, as a warm server start would
        t = time.perf_counter()
        m = load_musetalk(root, device=DEV, dtype=torch.float16 if DEV == "cuda" else torch.float32)
        sync()
        timings.append(time.perf_counter() - t)
        fingerprints = m.fingerprints
        del m
    return {"write_s": written, "load_s": timings, "bytes": sizes, "fingerprints": fingerprints}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny models, few runs: test this script")
    args = ap.parse_args()
    global DEV, SIZE
    if args.smoke:
        DEV, SIZE, args.runs = "cpu", "tiny", 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp())
    report: dict = {"versions": versions(), "date": time.strftime("%Y-%m-%d"),
                    "commit": os.environ.get("LIPSTREAM_COMMIT", "unknown")}
    print(report["versions"], flush=True)

    files = {
        "speech_16k_mono.wav": (16000, 1),
        "speech_48k_stereo.wav": (48000, 2),
        "speech_44k_stereo.mp3": (44100, 2),
        "speech_44k_stereo.m4a": (44100, 2),
    }
    for name, (rate, ch) in files.items():
        write_audio(tmp / name, speech_like(60.0, rate, seed=1), rate, channels=ch)

    t = time.perf_counter()
    m = load_musetalk(random_weights=True, size=SIZE, device=DEV, dtype=torch.float16 if DEV == "cuda" else torch.float32, seed=0)
    sync()
    report["load_random_full_fp16_s"] = time.perf_counter() - t
    print(f"models built in {report['load_random_full_fp16_s']:.2f} s", flush=True)

    report["speech_60s"] = {}
    for name in files:
        for fps in (30, 25):
            key = f"{name}@{fps}fps"
            report["speech_60s"][key] = r = time_speech(tmp / name, fps, m, args.runs)
            print(f"{key:32} total {r['total']['median']:.1f} ms (p90 {r['total']['p90']:.1f}) "
                  f"decode {r['decode']['median']:.1f} features {r['features']['median']:.1f} "
                  f"windows {r['windows']['median']:.2f}", flush=True)

    report["checks"] = checks(m, tmp)
    print(json.dumps(report["checks"], indent=1), flush=True)
    report["unet_vae_eager_b32"] = unet_vae_sanity(m)
    del m
    torch.cuda.empty_cache() if DEV == "cuda" else None
    report["full_checkpoint"] = full_checkpoint_load(tmp)
    print(report["full_checkpoint"], flush=True)
    report["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0
    print(report["unet_vae_eager_b32"], flush=True)

    (out / "foundation.json").write_text(json.dumps(report, indent=2))
    lines = [f"# Foundation benchmark ({report['date']}, {report['versions']['gpu']}, commit {report['commit']})", "",
             "| input (60 s) | fps | total median ms | p90 | decode | features | windows |", "|---|---|---|---|---|---|---|"]
    for key, r in report["speech_60s"].items():
        name, fps = key.split("@")
        lines.append(f"| {name} | {fps} | {r['total']['median']:.1f} | {r['total']['p90']:.1f} | "
                     f"{r['decode']['median']:.1f} | {r['features']['median']:.1f} | {r['windows']['median']:.2f} |")
    (out / "foundation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
