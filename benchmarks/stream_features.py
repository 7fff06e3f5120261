"""Streaming Whisper features against the offline ones: feature error and rendered-face PSNR per context.

For each (left context, look-ahead) the live path's features of one utterance (window by window,
as a session computes them) are compared with `whisper_features` of the whole utterance: relative
L2 error of the features and of every frame's 50x384 window, and the PSNR of the rendered faces
(UNet + VAE decode, fp32, the same latents) against the faces from the offline windows.

    python benchmarks/stream_features.py --out DIR [--size full|tiny] [--seconds 8] [--faces 8]

Random weights (no real checkpoint here): the numbers say how far the streaming window moves a
Whisper of this architecture, not how a trained one's mouth shapes change.

Rerun (CPU, the `lipstream` package installed, e.g. `pip install -e .`):

    python3 benchmarks/stream_features.py --out DIR --seconds 8 --faces 6     # 16 min on 2 cores

Reported in docs/BENCHMARKS.md (commit 0f52c60), "Live engine on the H200, first session (issue 14)", its
"Streaming features against offline" table (docs/results/stream_features_full_random.json).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from lipstream.audio.features import whisper_features
from lipstream.audio.windows import audio_windows
from lipstream.engine.runner import net_steps
from lipstream.fixtures import speech_like
from lipstream.live.features import streamed_features
from lipstream.models import load_musetalk

CONFIGS = [(0.25, 0), (0.5, 0), (1.0, 0), (2.0, 0), (4.0, 0), (1.0, 2), (1.0, 4), (2.0, 4), (4.0, 4)]
FACES = {(0.5, 0), (1.0, 0), (2.0, 0), (1.0, 4), (2.0, 4)}


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a - b) ** 2).mean())
    return 99.0 if mse == 0 else 10 * np.log10(1.0 / mse)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--size", default="full")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--faces", type=int, default=8, help="frames rendered per configuration for the PSNR")
    args = ap.parse_args()
    torch.manual_seed(0)
    m = load_musetalk(random_weights=True, size=args.size, device="cpu", seed=0, warn=False)
    audio = speech_like(args.seconds, 16_000, seed=11)
    offline = whisper_features(torch.from_numpy(audio), m)
    frames = max(1, round(args.seconds * 25))
    ref_windows = audio_windows(offline, 25, frames)
    picks = np.linspace(0, frames - 1, args.faces).round().astype(int)
    step = net_steps(m, decode_row=None)[False]
    latents = torch.randn(len(picks), 8, 32, 32) * 0.5
    with torch.inference_mode():
        ref_faces = step(latents, ref_windows[picks])
    rows = []
    for context_s, lookahead in CONFIGS:
        t = time.perf_counter()
        with torch.inference_mode():
            live = streamed_features(m, audio, round(context_s * 50), 1, lookahead)
        windows = audio_windows(live, 25, frames)
        err = (live - offline).flatten(1).norm(dim=1) / offline.flatten(1).norm(dim=1).clamp_min(1e-6)
        werr = (windows - ref_windows).flatten(1).norm(dim=1) / ref_windows.flatten(1).norm(dim=1).clamp_min(1e-6)
        row = {"context_s": context_s, "lookahead_ms": 20 * lookahead,
               "feature_rel_err_mean": round(float(err.mean()), 4), "feature_rel_err_p99": round(float(err.quantile(0.99)), 4),
               "window_rel_err_mean": round(float(werr.mean()), 4), "window_rel_err_max": round(float(werr.max()), 4),
               "features_s": round(time.perf_counter() - t, 2)}
        if (context_s, lookahead) in FACES:
            with torch.inference_mode():
                faces = step(latents, windows[picks])
            values = [psnr(faces[i], ref_faces[i]) for i in range(len(picks))]
            row.update({"face_psnr_min_db": round(min(values), 2), "face_psnr_mean_db": round(float(np.mean(values)), 2)})
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"size": args.size, "seconds": args.seconds, "faces": int(len(picks)), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    (args.out / "stream_features.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
