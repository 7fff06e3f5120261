"""What a shorter window look-ahead costs: frames rendered before their whole audio window is in.

A live frame's window is 10 Whisper steps, 4 before the frame's start and 6 from it (120 ms). With
`window_ahead_steps` = a (the `lowlatency` preset: 2), a frame renders once a steps past its start
are in, and the window's later steps repeat the last one in. Here the offline features of one
utterance are cut that way for every frame and compared with the whole windows: the windows'
relative L2 error, and the PSNR of the rendered faces (UNet + VAE decode, fp32, the same latents)
against the faces from the whole windows. "zero" fills the missing steps with zeros instead (what
a frame whose audio is late reads), for comparison.

    python3 benchmarks/window_ahead.py --out DIR [--size full|tiny] [--seconds 8] [--faces 6]

Random weights (no real checkpoint here): the numbers say how far the cut moves a network of this
architecture, not how a trained one's mouth shapes change; with real weights (`--models DIR`) they say that.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from lipstream.audio.features import whisper_features
from lipstream.audio.windows import LEFT_PAD_STEPS, audio_windows
from lipstream.engine.engines import net_steps
from lipstream.fixtures import speech_like
from lipstream.models import load_musetalk
from lipstream.models.config import AUDIO_DIM, HIDDEN_STATES, WINDOW_STEPS

AHEAD = (6, 4, 2, 1, 0)


def cut(windows: torch.Tensor, ahead: int, fill: str) -> torch.Tensor:
    """[frames, 50, 384] windows as a frame rendered `ahead` steps past its start sees them."""
    w = windows.reshape(len(windows), WINDOW_STEPS, HIDDEN_STATES, AUDIO_DIM).clone()
    keep = LEFT_PAD_STEPS + ahead
    if keep < WINDOW_STEPS:
        w[:, keep:] = w[:, keep - 1:keep] if fill == "edge" else 0
    return w.reshape_as(windows)


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = float(((a - b) ** 2).mean())
    return 99.0 if mse == 0 else 10 * np.log10(1.0 / mse)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--size", default="full", choices=("full", "tiny"))
    ap.add_argument("--models", type=Path, default=None, help="real weights (default: seeded random ones)")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--faces", type=int, default=6, help="frames rendered per row for the PSNR")
    args = ap.parse_args()
    torch.manual_seed(0)
    m = (load_musetalk(args.models, device="cpu") if args.models else
         load_musetalk(random_weights=True, size=args.size, device="cpu", seed=0, warn=False))
    audio = speech_like(args.seconds, 16_000, seed=11)
    frames = round(args.seconds * 25)
    with torch.inference_mode():
        whole = audio_windows(whisper_features(torch.from_numpy(audio), m), 25, frames)
    picks = np.linspace(4, frames - 5, args.faces).round().astype(int)
    step = net_steps(m, decode_row=None)[False]
    latents = torch.randn(len(picks), 8, 32, 32) * 0.5
    with torch.inference_mode():
        reference = step(latents, whole[picks])
    rows = []
    for fill in ("edge", "zero"):
        for ahead in AHEAD:
            if ahead == 6 and fill == "zero":
                continue
            windows = cut(whole, ahead, fill)
            err = (windows - whole).flatten(1).norm(dim=1) / whole.flatten(1).norm(dim=1).clamp_min(1e-6)
            with torch.inference_mode():
                faces = step(latents, windows[picks])
            values = [psnr(faces[i], reference[i]) for i in range(len(picks))]
            row = {"fill": fill, "window_ahead_ms": 20 * ahead, "waits_ms_less": 20 * (6 - ahead),
                   "window_rel_err_mean": round(float(err.mean()), 4), "window_rel_err_max": round(float(err.max()), 4),
                   "face_psnr_min_db": round(min(values), 2), "face_psnr_mean_db": round(float(np.mean(values)), 2)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"size": args.size, "weights": str(args.models) if args.models else "random", "seconds": args.seconds,
              "faces": int(len(picks)), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "rows": rows}
    (args.out / "window_ahead.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
