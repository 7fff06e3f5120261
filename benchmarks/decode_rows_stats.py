"""CPU experiment: how close can the mask-rows decode get with better GroupNorm statistics?

`python benchmarks/decode_rows_stats.py NOISE` decodes two frames of the bench avatar (full-size
random VAE, fp32) three ways: the full decode of a "generated" latent (the avatar's own latent
with NOISE x its spread added to latent rows 16-31, a new mouth), the plain crop from row 12
(GroupNorm over the decoded rows only), and the crop with the statistics of the rows above it
taken from a full decode of the avatar's own latent (what a per-avatar cache could hold).
Prints the face-box PSNR (alpha-weighted) of both crops against the full decode.
Needs .bench/avatars/anchor (benchmarks/avatar_bench.py).
"""
import math
import sys

sys.path.insert(0, "src")
import torch, torch.nn.functional as F
import torch.nn.modules.normalization as N
from lipstream.models import load_musetalk
from lipstream.models.config import VAE_SCALING_FACTOR
from lipstream.avatar import load_avatar
from lipstream.engine.decode import CroppedDecoder
torch.set_num_threads(2)
ROW = 12
m = load_musetalk(random_weights=True, size="full", components=("vae",), warn=False)
a = load_avatar('.bench/avatars/anchor', with_frames=False)
idx = [0, 120]
zref = m.vae.post_quant_conv(a.latents[idx, 4:].float() / VAE_SCALING_FACTOR)
g = torch.Generator().manual_seed(0)
zgen = zref.clone()
zgen[:, :, 16:] = zref[:, :, 16:] + float(sys.argv[1]) * zref[:, :, 16:].std() * torch.randn(zgen[:, :, 16:].shape, generator=g)  # a new mouth
alpha = a.masks[idx].float()[:, None] / 255
orig = F.group_norm
state = {"mode": "plain", "upper": [], "i": 0}
def gn(x, G, w, b, eps):
    if x.dim() != 4 or state["mode"] == "plain":
        return orig(x, G, w, b, eps)
    B, C, H, W = x.shape
    if state["mode"] == "record":
        r = ROW * H // 32
        up = x[:, :, :r].double().reshape(B, G, -1)
        state["upper"].append((up.sum(-1), (up ** 2).sum(-1), up.shape[-1]))
        return orig(x, G, w, b, eps)
    # combine: only layers after the crop (H < W)
    if H == W:
        state["i"] += 1
        return orig(x, G, w, b, eps)
    s_up, ss_up, n_up = state["upper"][state["i"]]; state["i"] += 1
    xs = x.double().reshape(B, G, -1)
    n = xs.shape[-1] + n_up
    mean = (xs.sum(-1) + s_up) / n
    var = (( xs ** 2).sum(-1) + ss_up) / n - mean ** 2
    y = ((xs - mean[..., None]) / torch.sqrt(var[..., None] + eps)).reshape_as(x).to(x.dtype)
    return y * w.view(1, C, 1, 1) + b.view(1, C, 1, 1)
N.F.group_norm = gn
to8 = lambda x: (x.float() / 2 + 0.5).clamp(0, 1) * 255
psnr = lambda d: [round(10 * math.log10(255 ** 2 / max(float((x ** 2).mean()), 1e-10)), 1) for x in d]
with torch.inference_mode():
    full = m.vae.decoder(zgen)
    plain = CroppedDecoder(m.vae.decoder, ROW, stats="rows")(zgen)
    state["mode"] = "record"; m.vae.decoder(zref)
    state["mode"] = "combine"; state["i"] = 0
    fixed = CroppedDecoder(m.vae.decoder, ROW, stats="rows")(zgen)
print("plain crop box PSNR", psnr(alpha * (to8(full) - to8(plain))))
print("crop + reference upper-row stats box PSNR", psnr(alpha * (to8(full) - to8(fixed))))
