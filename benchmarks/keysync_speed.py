"""How fast KeySync runs on this GPU, on seeded random full-size networks (the published shapes: the real cost).

Rows: the UNet's cost per frame in each precision, one clip sampled, the SVD VAE, the speech features, then
`generate` (latents and speech to 512x512 frames) over FRAMES frames per preset; `--profile` adds where one
UNet call's time goes (torch.profiler). Each row is printed and appended to OUT/keysync_speed.jsonl as it
comes, so a run cut short keeps what it measured.

    python benchmarks/keysync_speed.py OUT [--frames 650] [--presets fast,reference] [--profile]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from lipstream.keysync.load import random_keysync
from lipstream.keysync.options import KEYSYNC_PRESETS
from lipstream.keysync.pipeline import Inputs, generate
from lipstream.keysync.sampler import Conditions, sample
from lipstream.keysync.schedule import plan
from lipstream.keysync.speech import frames_of, hubert_features, wavlm_features


def timed(fn, runs: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(runs):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / runs


def row_log(path: Path):
    """say(**row): the row printed and appended to `path` (JSON lines) as it comes, so a run cut short keeps
    what it measured."""
    path.parent.mkdir(parents=True, exist_ok=True)
    log = open(path, "a")

    def say(**row) -> None:
        print(row, flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()

    return say


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--frames", type=int, default=650)
    p.add_argument("--presets", default="fast,reference")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    say = row_log(a.out / "keysync_speed.jsonl")

    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    m = random_keysync("full", dev)
    say(what="device", name=torch.cuda.get_device_name(), torch=torch.__version__)
    unet = m.networks.interpolation.unet
    with torch.inference_mode():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            unet.to(dtype)
            for clips in (3, 6):  # 3: one clip's three guidance passes
                x = torch.randn(clips * 14, 9, 64, 64, device=dev, dtype=dtype)
                c_noise = torch.randn(clips * 14, device=dev)
                audio = torch.randn(clips, 14, 1024, device=dev, dtype=dtype)
                s = timed(lambda: unet(x, c_noise, audio))
                say(what="unet call", dtype=str(dtype).removeprefix("torch."), frames=clips * 14,
                    ms_per_frame=round(s * 1e3 / clips / 14, 2))
        unet.float()
        cond = Conditions(torch.randn(1, 14, 2, 768, device=dev), torch.randn(14, 4, 64, 64, device=dev),
                          torch.ones(14, 1, 64, 64, device=dev), torch.randn(1, 2, 4, 64, 64, device=dev))
        noise = torch.randn(14, 4, 64, 64, device=dev)
        with torch.autocast("cuda", torch.bfloat16):
            s = timed(lambda: sample(m.networks.interpolation, cond, noise), runs=1)
        say(what="one clip sampled, bf16 autocast", ms_per_frame=round(s * 1e3 / 14, 1))
        vae = m.networks.vae
        z, px = torch.randn(14, 4, 64, 64, device=dev), torch.rand(14, 3, 512, 512, device=dev) * 2 - 1
        say(what="svd vae, 14 frames fp32", decode_ms=round(timed(lambda: vae.decode(z, frames=1), 1) * 1e3),
            encode_ms=round(timed(lambda: vae.encode(px), 1) * 1e3))
        frames = frames_of(torch.randn(a.frames * 640, device=dev) * 0.1)
        say(what=f"speech features of {a.frames} frames",
            hubert_ms=round(timed(lambda: hubert_features(m.hubert, frames), 1) * 1e3, 1),
            wavlm_ms=round(timed(lambda: wavlm_features(m.wavlm, frames), 1) * 1e3, 1))
        keyframe_speech, interpolation_speech = hubert_features(m.hubert, frames), wavlm_features(m.wavlm, frames)
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            x = torch.randn(42, 9, 64, 64, device=dev)
            c_noise, audio = torch.randn(42, device=dev), torch.randn(3, 14, 1024, device=dev)
            with torch.autocast("cuda", torch.bfloat16), profile(activities=[ProfilerActivity.CUDA]) as prof:
                unet(x, c_noise, audio)
                torch.cuda.synchronize()
            (a.out / "unet_profile.txt").write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=35))
    masks = torch.zeros(a.frames, 1, 64, 64, device=dev)
    masks[:, :, 30:, 12:52] = 1  # a lower face
    inputs = Inputs(torch.randn(a.frames, 4, 64, 64, device=dev) * 0.8, masks, keyframe_speech[:a.frames],
                    interpolation_speech[:a.frames])
    for preset in a.presets.split(","):
        options = KEYSYNC_PRESETS[preset]
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        t, first, n = time.perf_counter(), None, 0
        for _, video in generate(m.networks, plan(a.frames), inputs, options):
            torch.cuda.synchronize()
            first = first or time.perf_counter() - t
            n += video.shape[0]
        s = time.perf_counter() - t
        say(what="generate", preset=preset, clips_per_call=options.clips_per_call, frames=n, s=round(s, 1),
            first_chunk_s=round(first, 1), frames_per_s=round(n / s, 2),
            peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 1))


if __name__ == "__main__":
    main()
