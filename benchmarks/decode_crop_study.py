"""CPU study: face-box PSNR of cropped VAE decodes against the full decode, per crop point and row.

`python benchmarks/decode_crop_study.py [--frames 16] [--out F.json]` runs the full-size random
UNet (fp32, seed 0, as the H200 runs) on frames of the bench avatar with random audio windows,
then decodes each latent fully and cropped: after up block `after` (0 or 1), from latent row
`row` (or `p:r1:r2:r3`: progressively, from row r1 before up block 1, r2 before 2, r3 before 3),
GroupNorm statistics over all decoded rows or without the first `skip` latent rows (the
ones the zero-padded top edge reaches). PSNR is of the luma, alpha-weighted by the blend mask, over
the 256 x 256 face box: what the H200's box_psnr measures, in face space. It also prints each
variant's decoder GFLOPs with fused upsamplers (engine/upsample.py), the speed model that predicted
the mask-rows run within 1% (fps scales with 1 / FLOPs of UNet + decoder).
Needs .bench/avatars/anchor (benchmarks/avatar_bench.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from lipstream.avatar import load_avatar  # noqa: E402
from lipstream.engine.upsample import fuse_upsamplers  # noqa: E402
from lipstream.models import load_musetalk  # noqa: E402
from lipstream.models.config import UNET_TIMESTEP, VAE_SCALING_FACTOR  # noqa: E402

_group_norm = F.group_norm
SKIP = {"rows": 0}  # rows of the current map to leave out of GroupNorm statistics (0: plain)
STATS = {"mode": "plain"}  # or linear / near / mirror: guess the cut rows' statistics from the decoded rows'


def skipping_group_norm(x, groups, weight=None, bias=None, eps=1e-5):
    cut = x.dim() == 4 and x.shape[-2] < x.shape[-1]
    s = SKIP["rows"] * x.shape[-1] // 256 if cut else 0
    if not s and not (cut and STATS["mode"] != "plain"):
        return _group_norm(x, groups, weight, bias, eps)
    b, c, h, w = x.shape
    if s:
        part = x[:, :, s:].reshape(b, groups, -1)
        mean, var = part.mean(-1), part.var(-1, unbiased=False)
    else:
        rows = x.reshape(b, groups, c // groups, h, w)
        m1, m2 = rows.mean(dim=(2, 4)), (rows ** 2).mean(dim=(2, 4))  # [b, groups, h] per-row moments
        missing = w - h
        if STATS["mode"] in ("near", "mirror"):  # the cut rows look like the first decoded ones
            k = max(1, h // 4) if STATS["mode"] == "near" else min(h, missing)  # a quarter / as many as were cut
            g1, g2 = m1[..., :k].mean(-1), m2[..., :k].mean(-1)
        else:  # a straight line through the per-row moments, read at the cut rows' centre
            y = torch.arange(missing, w, dtype=x.dtype, device=x.device)
            yc, centre = y - y.mean(), (missing - 1) / 2 - y.mean()
            g1 = m1.mean(-1) + (m1 * yc).sum(-1) / (yc ** 2).sum() * centre
            g2 = m2.mean(-1) + (m2 * yc).sum(-1) / (yc ** 2).sum() * centre
        e1 = (h * m1.mean(-1) + missing * g1) / w
        e2 = (h * m2.mean(-1) + missing * g2) / w
        mean, var = e1, torch.maximum(e2 - e1 ** 2, 0.25 * (m2.mean(-1) - m1.mean(-1) ** 2))
    y = (x.reshape(b, groups, -1) - mean[..., None]) / torch.sqrt(var[..., None] + eps)
    return y.reshape_as(x) * weight[:, None, None] + bias[:, None, None]


def progressive(d, z: torch.Tensor, rows: tuple[int, ...]) -> torch.Tensor:
    """Cut to latent row rows[i] before up block i + 1: later, costlier stages may start lower."""
    x = d.mid_block(d.conv_in(z), None)
    for i, up in enumerate(d.up_blocks):
        if 1 <= i <= len(rows):
            scale = x.shape[-1] // z.shape[-1]
            cut = scale * rows[i - 1] - (x.shape[-1] - x.shape[-2])  # rows already cut before this block
            x = x[:, :, cut:]
        x = up(x, None)
    x = d.conv_out(d.conv_act(d.conv_norm_out(x)))
    return F.pad(x, (0, 0, x.shape[-1] - x.shape[-2], 0))


def luma(img: torch.Tensor) -> torch.Tensor:
    rgb = (img.float() / 2 + 0.5).clamp(0, 1) * 255
    return 0.299 * rgb[:, 0] + 0.587 * rgb[:, 1] + 0.114 * rgb[:, 2]


def psnr(a: torch.Tensor, b: torch.Tensor, alpha: torch.Tensor) -> list[float]:
    mse = ((alpha * (luma(a) - luma(b))) ** 2).mean(dim=(1, 2))
    return [10 * math.log10(255 ** 2 / max(float(v), 1e-10)) for v in mse]


def gflops(fn, *args) -> float:
    counter = FlopCounterMode(display=False)
    with counter:
        fn(*args)
    return counter.get_total_flops() / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--seed", type=int, default=0, help="of the random audio windows")
    p.add_argument("--avatar", default=".bench/avatars/anchor")
    p.add_argument("--variants", default="0:12:0,0:8:0,0:6:0,0:4:0,1:12:0,1:8:0,0:8:2,0:12:2",
                   help="after:row:skip, comma separated")
    p.add_argument("--stats", default="plain", choices=("plain", "linear", "near", "mirror"),
                   help="GroupNorm statistics of a cut map: its own rows, or a guess of the cut rows' too")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(2)
    F.group_norm = skipping_group_norm
    m = load_musetalk(random_weights=True, size="full", seed=0, components=("unet", "vae", "whisper"), warn=False)
    a = load_avatar(args.avatar, with_frames=False)
    idx = torch.linspace(0, a.num_frames - 1, args.frames).long()
    windows = torch.randn(args.frames, 50, 384, generator=torch.Generator().manual_seed(args.seed))
    alpha = a.masks[idx].float() / 255
    d = fuse_upsamplers(m.vae.decoder, "phases")
    with torch.inference_mode():
        pred = m.unet(a.latents[idx].float(), torch.tensor([UNET_TIMESTEP]),
                      encoder_hidden_states=m.pe(windows)).sample
        z = m.vae.post_quant_conv(pred / VAE_SCALING_FACTOR)
        full = torch.cat([m.vae.decoder(z[i:i + 4]) for i in range(0, len(z), 4)])
        unet_gf = gflops(lambda: m.unet(a.latents[:1].float(), torch.tensor([UNET_TIMESTEP]),
                                        encoder_hidden_states=m.pe(windows[:1])))
        plain_gf = unet_gf + gflops(m.vae.decoder, z[:1])
        fused = torch.cat([d(z[i:i + 4]) for i in range(0, len(z), 4)])
        fused_gf = gflops(fuse_upsamplers(m.unet, "phases"), a.latents[:1].float(), torch.tensor([UNET_TIMESTEP]),
                          m.pe(windows[:1])) + gflops(d, z[:1])
        rows = [{"variant": "full, fused upsamplers", "gflops": fused_gf, "psnr": psnr(fused, full, alpha)}]
        print(json.dumps({"unet_gf": unet_gf, "plain_gf": plain_gf, **rows[0]}), flush=True)
        unet_fused_gf = gflops(fuse_upsamplers(m.unet, "phases"), a.latents[:1].float(),
                               torch.tensor([UNET_TIMESTEP]), m.pe(windows[:1]))
        for v in args.variants.split(","):
            if v.startswith("p:"):  # progressive: p:r1:r2:r3
                cuts = tuple(map(int, v.split(":")[1:]))
                decode, extra = (lambda t, c=cuts: progressive(d, t, c)), {"rows": cuts}
            else:
                after, row, skip = map(int, v.split(":"))
                cuts = (row, row, row) if after == 0 else (0, row, row)  # cut after up block `after`
                decode, extra = (lambda t, c=cuts: progressive(d, t, c)), \
                    {"after": after, "row": row, "skip": skip}
            SKIP["rows"], STATS["mode"] = extra.get("skip", 0) * 8, args.stats
            out = torch.cat([decode(z[i:i + 4]) for i in range(0, len(z), 4)])
            SKIP["rows"], STATS["mode"] = 0, "plain"
            gf = unet_fused_gf + gflops(decode, z[:1])
            rows.append({"variant": v, **extra, "stats": args.stats, "gflops": gf, "psnr": psnr(out, full, alpha)})
            r = rows[-1]
            print(json.dumps({"variant": v, "gflops": round(gf, 1), "predicted_fps": round(474 * plain_gf / gf),
                              "psnr_min": round(min(r["psnr"]), 2),
                              "psnr_mean": round(sum(r["psnr"]) / len(r["psnr"]), 2)}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"unet_gf": unet_gf, "plain_gf": plain_gf, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
