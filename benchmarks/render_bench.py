"""Renderer checks and timings on the GPU, in one run: `python benchmarks/render_bench.py --track T --out DIR`.

1. Compiles the 10 s 1080p fixture loop (landmarks from --track, made on the CPU machine).
2. Renders 4 s of speech with the fast path and with the reference path (eager fp32, numpy
   blending), losslessly, and reports the PSNR of the face boxes (issue 4: >= 40 dB).
3. Renders the 25.8 s / 775-frame 30 fps monologue with default settings and reports fps and
   stage times (the baseline for the speed issue).
`--smoke` runs the same on the CPU with tiny models and a small loop, to test this script.
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
from lipstream.fixtures import speech_like, write_audio  # noqa: E402
from lipstream.fixtures.avatar import action_loop  # noqa: E402
from lipstream.models import load_musetalk  # noqa: E402
from lipstream.render import render_program  # noqa: E402
from lipstream.script import single_scene  # noqa: E402


def decode_y(path: Path) -> list[np.ndarray]:
    with av.open(str(path)) as c:
        return [f.to_ndarray() for f in c.decode(video=0)]


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * math.log10(255 ** 2 / mse)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    ap.add_argument("--track", type=Path)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    out, work = args.out, Path("/tmp/lipstream-render-bench")
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not args.smoke
    device, size = ("cuda", "full") if cuda else ("cpu", "tiny")
    w, h, seconds = (1920, 1080, 10.0) if not args.smoke else (640, 360, 1.0)
    report: dict = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0) if cuda else "cpu",
                    "commit": os.environ.get("LIPSTREAM_COMMIT", "unknown")}

    loop = work / "anchor.mp4"
    action_loop(loop, width=w, height=h, seconds=seconds, fps=25, seed=0)
    fast = load_musetalk(random_weights=True, size=size, device=device, seed=0)
    compile_avatar(loop, work / "avatars", fast.vae, fast.fingerprints["vae"], track_file=args.track,
                   force=True, progress=False)
    avatar = load_avatar(work / "avatars" / "anchor")

    speech4 = write_audio(work / "speech4.wav", speech_like(4.0 if not args.smoke else 1.0, 16000, seed=2), 16000)
    program = single_scene("anchor", speech4)
    r_fast = render_program(program, work / "fast.mp4", fast, avatars_dir=work / "avatars", crf=0, progress=False)
    ref_models = load_musetalk(random_weights=True, size=size, device=device, dtype=torch.float32, seed=0)
    r_ref = render_program(program, work / "ref.mp4", ref_models, avatars_dir=work / "avatars", crf=0,
                           reference=True, progress=False)
    del ref_models
    fa, fb = decode_y(work / "fast.mp4"), decode_y(work / "ref.mp4")
    values = []
    for j, (x, y) in enumerate(zip(fa, fb)):
        x1, y1, x2, y2 = avatar.boxes[ping_pong(j, avatar.num_frames)].tolist()
        values.append(psnr(x[y1:y2, x1:x2], y[y1:y2, x1:x2]))
    report["psnr_face_boxes_db"] = {"min": min(values), "mean": float(np.mean(values)), "frames": len(values)}
    report["equivalence_renders"] = {"fast_fps": r_fast.render_fps, "reference_fps": r_ref.render_fps}
    print("PSNR fast vs reference (face boxes, I420):", report["psnr_face_boxes_db"], flush=True)

    mono = write_audio(work / "monologue.wav", speech_like(25.8 if not args.smoke else 2.0, 16000, seed=3), 16000)
    program = single_scene("anchor", mono)
    runs = []
    for _ in range(2):  # the second run is warm (cuDNN choices, allocator)
        r = render_program(program, work / "monologue.mp4", fast, avatars_dir=work / "avatars", fps=30,
                           progress=False)
        runs.append({"frames": r.frames, "wall_s": r.wall_s, "fps": r.render_fps, "first_frame_s": r.first_frame_s,
                     **r.timings})
        print("monologue:", runs[-1], flush=True)
    report["monologue_30fps"] = runs
    report["peak_gpu_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0
    (out / "render_bench.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
