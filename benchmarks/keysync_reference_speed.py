"""KeySync's reference code against LipStream's KeySync on one GPU: random full-size networks, the same frames.

The reference's pieces are its own classes (sgm, from a KeySync checkout named by $LIPSTREAM_KEYSYNC_REFERENCE,
loaded as tests/keysync_reference.py loads them), run as its dubbing script runs them: one keyframe clip a
sampler call in fp32, that clip's frames decoded; the segments between keyframes under fp16 autocast, two
clips a sampler call; every frame decoded on its own (`decoding_t` 1) in fp32 by the SVD video decoder. Each
piece is timed on the GPU and summed over the schedule of FRAMES frames (the reference's chunking,
keysync/schedule.py). Its script as a whole cannot run here: it reads precomputed latents, landmarks and
HuBERT features from files and its checkpoints from disk. LipStream's `generate` then runs the same
FRAMES frames, per preset, whole. Rows are printed and appended to OUT/keysync_reference.jsonl.

    LIPSTREAM_KEYSYNC_REFERENCE=DIR python3 benchmarks/keysync_reference_speed.py OUT [--frames 100]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import keysync_reference as ref  # noqa: E402
from keysync_speed import row_log  # noqa: E402  (this script's folder is on the path: it is run as a script)

from lipstream.keysync.load import _shapes, random_keysync  # noqa: E402
from lipstream.keysync.options import KEYSYNC_PRESETS  # noqa: E402
from lipstream.keysync.pipeline import Inputs, generate  # noqa: E402
from lipstream.keysync.schedule import CLIP, plan  # noqa: E402

SVD_DECODER = {**ref.SGM_DECODER, "ch": 128, "ch_mult": [1, 2, 4, 4], "resolution": 256}  # the yaml's


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def seconds(fn, dev: torch.device, runs: int = 2) -> float:
    fn()
    sync(dev)
    t = time.perf_counter()
    for _ in range(runs):
        fn()
    sync(dev)
    return (time.perf_counter() - t) / runs


def lower_face(n: int, lat: int, dev: torch.device) -> torch.Tensor:
    mask = torch.zeros(n, 1, lat, lat, device=dev)
    mask[:, :, lat * 15 // 32:, lat * 3 // 16:lat * 13 // 16] = 1
    return mask


def reference_pieces(size: str, dev: torch.device, say) -> dict:
    """Seconds per keyframe clip, per interpolation clip and per decoded frame, by the reference's code."""
    if ref.checkout() is None:
        raise SystemExit(f"${ref.ENV_VAR}: a KeySync checkout (the folder holding sgm/) is required, with einops")
    torch.manual_seed(0)
    pieces = {}
    for name, clips in (("keyframe", 1), ("interpolation", 2)):
        config, width, lat = _shapes(size, name == "interpolation")
        network, embedder, run = ref.sampling(config, width, steps=10, device=dev)
        n = clips * CLIP
        reference = torch.randn(clips, 4, lat, lat, device=dev) if name == "keyframe" else torch.randn(
            clips, 2, 4, lat, lat, device=dev)
        args = (torch.randn(clips, CLIP, 2, width, device=dev), torch.randn(n, 4, lat, lat, device=dev),
                lower_face(n, lat, dev), reference, torch.randn(n, 4, lat, lat, device=dev))
        # the script: fp16 autocast between keyframes (on a CPU, a check of this script, bf16)
        with torch.autocast(dev.type, enabled=name == "interpolation"):
            pieces[name] = seconds(lambda run=run: run(*args), dev, runs=1) / clips
        say(what=f"reference {name} clip sampled", clips_a_call=clips, s_per_clip=round(pieces[name], 3),
            autocast=name == "interpolation")
        del network, embedder
    temporal_ae, = ref.load("sgm.modules.autoencoding.temporal_ae")
    decoder = temporal_ae.VideoDecoder(**(SVD_DECODER if size == "full" else ref.SGM_DECODER)).to(dev).eval()
    z = torch.randn(CLIP, 4, lat, lat, device=dev)
    with torch.no_grad():
        per_clip = seconds(lambda: [decoder(z[i:i + 1], timesteps=1) for i in range(CLIP)], dev, runs=1)
    pieces["decode"] = per_clip / CLIP
    say(what="reference frame decoded (one a call, fp32)", ms_per_frame=round(pieces["decode"] * 1e3, 1))
    return pieces


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--frames", type=int, default=100)
    p.add_argument("--presets", default="reference,fast")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny networks (with --device cpu: a check of this script)")
    a = p.parse_args()
    size = "tiny" if a.tiny else "full"
    say = row_log(a.out / "keysync_reference.jsonl")

    torch.backends.cudnn.benchmark = True
    dev = torch.device(a.device)
    say(what="device", name=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", torch=torch.__version__,
        frames=a.frames, networks=size)
    pieces = reference_pieces(size, dev, say)
    schedule = plan(a.frames)
    keyframe_clips = sum(len(c.clips) for c in schedule.chunks)
    segments = sum(len(c.segments) for c in schedule.chunks)
    total = (keyframe_clips * (pieces["keyframe"] + CLIP * pieces["decode"])
             + segments * (pieces["interpolation"] + CLIP * pieces["decode"]))
    say(what="reference, summed over the schedule", frames=schedule.frames, keyframe_clips=keyframe_clips,
        segments=segments, s=round(total, 1), frames_per_s=round(schedule.frames / total, 2))
    m = random_keysync(size, dev)
    _, width, lat = _shapes(size, False)
    inputs = Inputs(torch.randn(a.frames, 4, lat, lat, device=dev) * 0.8, lower_face(a.frames, lat, dev),
                    torch.randn(a.frames, 2, width, device=dev), torch.randn(a.frames, 2, width, device=dev))
    for preset in a.presets.split(","):
        options = KEYSYNC_PRESETS[preset]
        for run in ("first", "second"):  # the first pays cuDNN's choices and the bf16 copies
            sync(dev)
            t, n = time.perf_counter(), 0
            for _, video in generate(m.networks, schedule, inputs, options):
                n += video.shape[0]
            sync(dev)
            s = time.perf_counter() - t
            say(what="lipstream generate", preset=preset, run=run, frames=n, s=round(s, 1),
                frames_per_s=round(n / s, 2), times_the_reference=round(total / s, 2))


if __name__ == "__main__":
    main()
