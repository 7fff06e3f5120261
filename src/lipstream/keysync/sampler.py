"""KeySync's sampler: Euler steps over a fixed table of noise levels, each step three passes of the UNet
(no speech and no reference, the reference alone, both) mixed by the speech and reference guidance scales.

The numbers are the reference inference's: the Align-Your-Steps table of 11 levels from 700 to 0.002 (and 0:
11 steps), v-prediction with c_noise = 0.25 ln sigma, the latent kept outside the mask at every pass, the
unconditioned passes given zeros for the projected speech and the reference latents, guidance
e_uc + 2 (e_ref - e_uc) + 5 (e_full - e_ref). Fewer steps or guidance stopped at a noise level (the `draft`
preset, keysync/options.py) cut the UNet's passes and leave the reference's maths.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lipstream.models.keysync import KeySyncNet

SCALE = 0.18215  # the SVD VAE's latent scale: conditions are latents / SCALE, the sampled ones latents * SCALE
AYS_SIGMAS = (700.00, 54.5, 15.886, 7.977, 4.248, 1.789, 0.981, 0.403, 0.173, 0.034, 0.002)


MIN_STEPS = 4


def sigmas(steps: int = 10) -> torch.Tensor:
    """The noise levels, highest first, with 0 appended (float64): the table itself for 10, log-linearly
    resampled for any other count (the reference's rule above 10; below it, fewer passes than the reference
    makes, from 700 to 0.002 all the same)."""
    if steps < MIN_STEPS:
        raise ValueError(f"steps: {steps}; at least {MIN_STEPS} are allowed")
    levels = np.array(AYS_SIGMAS)
    if steps != 10:
        levels = np.exp(np.interp(np.linspace(0, 1, steps), np.linspace(0, 1, len(levels)), np.log(levels[::-1])))
        levels = levels[::-1].copy()
    return torch.cat([torch.from_numpy(levels), torch.zeros(1, dtype=torch.float64)])


@dataclass
class Conditions:
    """What B clips of T frames are sampled under.

    speech: [B, T, 2, 768] features (two 50 Hz tokens a frame); latents: [B*T, 4, h, w], the frames' own
    (scaled) latents, kept outside the mask; mask: [B*T, 1, h, w], 1 where the mouth is generated;
    reference: scaled latents, [B, 4, h, w] (keyframes: the identity frame) or [B, 2, 4, h, w]
    (interpolation: the keyframes at the clip's two ends)."""

    speech: torch.Tensor
    latents: torch.Tensor
    mask: torch.Tensor
    reference: torch.Tensor


def _frames_in(net: KeySyncNet, reference: torch.Tensor, frames: int) -> torch.Tensor:
    """The channels after the noisy latent, per frame: the reference latent (keyframes), or the two
    keyframes at the ends with the learned latent between and a 1/0 channel saying which (interpolation)."""
    if not net.interpolates:
        return reference.repeat_interleave(frames, dim=0)
    b, _, c, h, w = reference.shape
    middle = net.model.learned_mask.to(reference.dtype).expand(b, frames - 2, c, h, w)
    latents = torch.cat([reference[:, :1], middle, reference[:, 1:]], dim=1)
    ends = torch.zeros(b, frames, 1, h, w, dtype=reference.dtype, device=reference.device)
    ends[:, 0] = ends[:, -1] = 1.0
    return torch.cat([latents, ends], dim=2).flatten(0, 1)


def denoise(net: KeySyncNet, x: torch.Tensor, sigma: torch.Tensor, speech: torch.Tensor, frames_in: torch.Tensor,
            latents: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The denoised latents [N, 4, h, w] at noise level sigma [N]: v-prediction, the outside kept."""
    s = sigma[:, None, None, None]
    c_skip, c_out, c_in = 1.0 / (s ** 2 + 1.0), -s / (s ** 2 + 1.0) ** 0.5, 1.0 / (s ** 2 + 1.0) ** 0.5
    x = x * mask + latents * (1.0 - mask)
    dtype = net.unet.time_embed[0].weight.dtype  # the UNet's: its inputs in it, its output back in the sampler's
    out = net.unet(torch.cat([x * c_in, frames_in], dim=1).to(dtype), 0.25 * sigma.log(), speech.to(dtype))
    return (out.to(x.dtype) * c_out + x * c_skip) * mask + latents * (1.0 - mask)


def sample(net: KeySyncNet, cond: Conditions, noise: torch.Tensor, steps: int = 10, audio_scale: float = 5.0,
           reference_scale: float = 2.0, guidance_until: float = 0.0) -> torch.Tensor:
    """[B*T, 4, h, w] scaled latents sampled from `noise` (unit Gaussian, the same shape) under `cond`.
    Steps from a noise level below `guidance_until` run one pass with every condition, unguided (0: every step
    guided, as the reference): a third of the UNet's work there."""
    b, frames = cond.speech.shape[:2]
    speech = net.audio(cond.speech.to(net.audio.linear.weight.dtype))
    reference = cond.reference / SCALE
    three = lambda t: torch.cat([t] * 3)  # noqa: E731
    speech = torch.cat([torch.zeros_like(speech), torch.zeros_like(speech), speech])
    frames_in = _frames_in(net, torch.cat([torch.zeros_like(reference), reference, reference]), frames)
    latents, mask = three(cond.latents), three(cond.mask)
    levels = sigmas(steps).to(noise.device)
    x = noise * torch.sqrt(1.0 + levels[0] ** 2.0)
    ones = x.new_ones([x.shape[0]])
    n = x.shape[0]
    for i in range(len(levels) - 1):
        sigma, following = ones * levels[i], ones * levels[i + 1]
        if levels[i] < guidance_until:  # the last third of each batch holds every condition
            denoised = denoise(net, x, sigma, speech[-b:], frames_in[-n:], latents[-n:], mask[-n:])
        else:
            e_uc, e_ref, e_full = denoise(net, three(x), three(sigma), speech, frames_in, latents, mask).chunk(3)
            denoised = audio_scale * (e_full - e_ref) + reference_scale * (e_ref - e_uc) + e_uc
        x = x + (following - sigma)[:, None, None, None] * ((x - denoised) / sigma[:, None, None, None])
    return x
