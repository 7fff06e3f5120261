"""How fast KeySync runs on this GPU, on seeded random full-size networks (the published shapes: the real cost).

Rows: the UNet's cost per frame in each precision, one clip sampled, the SVD VAE, the speech features, then
`generate` (latents and speech to 512x512 frames) over FRAMES frames per preset; `--profile` adds where one
UNet call's time goes (torch.profiler). Each row is printed and appended to OUT/keysync_speed.jsonl as it
comes, so a run cut short keeps what it measured.

`--versus-reference`: KeySync's own code against LipStream's on the same frames instead. The reference's
pieces are its own classes (sgm, from a KeySync checkout named by $LIPSTREAM_KEYSYNC_REFERENCE, loaded as
tests/keysync_reference.py loads them), run as its dubbing script runs them: one keyframe clip a sampler
call in fp32, that clip's frames decoded; the segments between keyframes under fp16 autocast, two clips a
sampler call; every frame decoded on its own (`decoding_t` 1) in fp32 by the SVD video decoder. Each piece
is timed and summed over the schedule of FRAMES frames (the reference's chunking, keysync/schedule.py): its
script as a whole reads precomputed latents, landmarks and HuBERT features and its checkpoints from disk.
LipStream's `generate` then runs the same frames, per preset, whole (OUT/keysync_reference.jsonl).
`--tiny --device cpu`: a check of that path on tiny networks.

`--work`: no GPU: the UNet's arithmetic per frame-pass (torch's FLOP counter, the published shapes on the meta
device) and what each preset's schedule of FRAMES frames asks of it: the floor under any kernel's speed.

    python benchmarks/keysync_speed.py OUT [--frames 650] [--presets fast,reference] [--profile]
    python benchmarks/keysync_speed.py OUT --work --frames 775 --presets reference,draft
    LIPSTREAM_KEYSYNC_REFERENCE=DIR python benchmarks/keysync_speed.py OUT --versus-reference --frames 100
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from lipstream.keysync.load import _shapes, random_keysync
from lipstream.keysync.options import KEYSYNC_PRESETS
from lipstream.keysync.pipeline import Inputs, generate
from lipstream.keysync.sampler import Conditions, sample
from lipstream.keysync.schedule import CLIP, plan
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
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import keysync_reference as ref

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
    svd = {**ref.SGM_DECODER, "ch": 128, "ch_mult": [1, 2, 4, 4], "resolution": 256}  # the yaml's decoder
    with dev:  # initialised there, not on the CPU
        decoder = temporal_ae.VideoDecoder(**(svd if size == "full" else ref.SGM_DECODER)).to(dev).eval()
    z = torch.randn(CLIP, 4, lat, lat, device=dev)
    with torch.no_grad():
        per_clip = seconds(lambda: [decoder(z[i:i + 1], timesteps=1) for i in range(CLIP)], dev, runs=1)
    pieces["decode"] = per_clip / CLIP
    say(what="reference frame decoded (one a call, fp32)", ms_per_frame=round(pieces["decode"] * 1e3, 1))
    return pieces


def versus_reference(a, say) -> None:
    """KeySync's own code, piece by piece over the schedule, then LipStream's generate on the same frames."""
    size = "tiny" if a.tiny else "full"
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



def work(a, say) -> None:
    """The UNet's FLOPs per frame-pass, and each preset's passes over FRAMES frames (padded to whole segments
    as a scene is: keysync/engine.py), counted on the meta device: arithmetic, no time."""
    from torch.utils.flop_counter import FlopCounterMode

    from lipstream.keysync.sampler import sigmas
    from lipstream.keysync.schedule import STEP
    from lipstream.models.keysync import KeySyncNet, KeySyncUNetConfig

    config = KeySyncUNetConfig()
    with torch.device("meta"):
        unet = KeySyncNet(type(config)(**{**config.to_dict(), "in_channels": 9}), latent_size=64).unet
        x, c_noise, audio = torch.empty(CLIP, 9, 64, 64), torch.empty(CLIP), torch.empty(1, CLIP, 1024)
        with FlopCounterMode(display=False) as counter:
            unet(x, c_noise, audio)
    per_pass = counter.get_total_flops() / CLIP
    say(what="unet work", tflop_per_frame_pass=round(per_pass / 1e12, 3))
    padded = max(a.frames, CLIP)
    padded += (STEP - (padded - 1) % STEP) % STEP
    schedule = plan(padded)
    slots = sum(len(clip) for chunk in schedule.chunks for clip in chunk.clips) + CLIP * len(schedule.segments)
    for preset in a.presets.split(","):
        o = KEYSYNC_PRESETS[preset]
        levels = sigmas(o.steps)[:-1]
        passes = sum(1 if level < o.guidance_until else 3 for level in levels.tolist())
        say(what="schedule work", preset=preset, frames=a.frames, slots=slots, passes_per_slot=passes,
            frame_passes=slots * passes, pflop=round(slots * passes * per_pass / 1e15, 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--frames", type=int, default=650)
    p.add_argument("--presets", default="fast,reference")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--versus-reference", action="store_true", help="KeySync's own code against LipStream's")
    p.add_argument("--device", default="cuda", help="with --versus-reference")
    p.add_argument("--tiny", action="store_true", help="with --versus-reference: tiny networks (a check, on a CPU)")
    p.add_argument("--work", action="store_true", help="the UNet's FLOPs per frame-pass and per preset (no GPU)")
    a = p.parse_args()
    if a.work:
        work(a, row_log(a.out / "keysync_work.jsonl"))
        return
    torch.backends.cudnn.benchmark = True
    if a.versus_reference:
        versus_reference(a, row_log(a.out / "keysync_reference.jsonl"))
        return
    say = row_log(a.out / "keysync_speed.jsonl")
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
        unet.to(torch.bfloat16)  # the product leaves cuDNN's algorithm search off (these rows turn it on)
        x = torch.randn(6 * 14, 9, 64, 64, device=dev, dtype=torch.bfloat16)
        c_noise, audio = torch.randn(6 * 14, device=dev), torch.randn(6, 14, 1024, device=dev, dtype=torch.bfloat16)
        torch.backends.cudnn.benchmark = False
        say(what="unet call, cudnn.benchmark off", dtype="bfloat16", frames=84,
            ms_per_frame=round(timed(lambda: unet(x, c_noise, audio)) * 1e3 / 84, 2))
        torch.backends.cudnn.benchmark = True
        for w in unet.parameters():  # a layout ablation: NHWC 2-D convolutions (the 3-frame ones' weights are 5-D)
            if w.dim() == 4:
                w.data = w.data.contiguous(memory_format=torch.channels_last)
        x = torch.randn(6 * 14, 9, 64, 64, device=dev, dtype=torch.bfloat16).contiguous(memory_format=torch.channels_last)
        c_noise, audio = torch.randn(6 * 14, device=dev), torch.randn(6, 14, 1024, device=dev, dtype=torch.bfloat16)
        say(what="unet call, channels_last", dtype="bfloat16", frames=84,
            ms_per_frame=round(timed(lambda: unet(x, c_noise, audio)) * 1e3 / 84, 2))
        for w in unet.parameters():
            w.data = w.data.contiguous()
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
        half = m.networks.cast(vae, torch.bfloat16)
        zb = z.to(torch.bfloat16)
        say(what="svd vae, 14 frames bf16 (preset draft)", decode_ms=round(timed(lambda: half.decode(zb, frames=1), 1) * 1e3))
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
