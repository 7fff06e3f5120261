"""KeySync from latents and speech to 512x512 frames, chunk by chunk as the reference inference runs it.

Per chunk (keysync/schedule.py): the keyframe model samples its clips (all in one batch), the previous
chunk's last keyframe is put in front, the interpolation model samples the segments between neighbouring
keyframes (`clips_per_call` at a time), each segment's ends are set back to its keyframes, every frame is
decoded on its own (the reference's `decoding_t` 1: in one batch here) and the frame two segments share is
their average. A chunk's last frame is held back: the next chunk decodes that keyframe again as its first
frame, and the reference keeps that one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
import copy
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from lipstream.keysync.options import KeySyncOptions
from lipstream.keysync.sampler import Conditions, sample
from lipstream.keysync.schedule import CLIP, STEP, Schedule
from lipstream.models.keysync import KeySyncNet
from lipstream.models.svd_vae import SVDVAE

SCALE = 0.18215
M = TypeVar("M", bound=torch.nn.Module)


@dataclass
class KeySyncNetworks:
    keyframe: KeySyncNet
    interpolation: KeySyncNet
    vae: SVDVAE  # fp32 weights; decodes in the options' decode_dtype
    _copies: dict = field(default_factory=dict, repr=False)

    def cast(self, net: M, dtype: torch.dtype) -> M:
        """`net` with its weights in `dtype`: a copy made once and kept (the fp32 weights stay, for the
        presets that sample under autocast or decode in fp32)."""
        if dtype == torch.float32:
            return net
        key = (id(net), dtype)
        if key not in self._copies:
            self._copies[key] = copy.deepcopy(net).to(dtype)
        return self._copies[key]


@dataclass
class Inputs:
    """latents: [F, 4, h, w] the frames' own, scaled; masks: [F, 1, h, w] where the mouth is generated;
    keyframe_speech / interpolation_speech: [F, 2, 768] HuBERT / WavLM tokens. F: at least the schedule's."""

    latents: torch.Tensor
    masks: torch.Tensor
    keyframe_speech: torch.Tensor
    interpolation_speech: torch.Tensor


def _sample_in_calls(nets: KeySyncNetworks, net: KeySyncNet, cond: Conditions, noise: torch.Tensor,
                     options: KeySyncOptions, dtype: torch.dtype, check: Callable[[], None]) -> torch.Tensor:
    """sample() over the clips of `cond`, `clips_per_call` at a time (clips do not see each other), in `dtype`:
    under autocast (`options.autocast`, as the reference samples: the weights and the sampler's state fp32,
    matrix products in `dtype`, normalisations in fp32), or with the weights cast to it once."""
    out = []
    n = options.clips_per_call
    half = dtype != torch.float32
    net = net if options.autocast else nets.cast(net, dtype)
    with torch.autocast(noise.device.type, dtype=dtype, enabled=half and options.autocast):
        for i in range(0, cond.speech.shape[0], n):
            check()
            part = Conditions(cond.speech[i:i + n], cond.latents[i * CLIP:(i + n) * CLIP],
                              cond.mask[i * CLIP:(i + n) * CLIP], cond.reference[i:i + n])
            out.append(sample(net, part, noise[i * CLIP:(i + n) * CLIP], options.steps, options.audio_scale,
                              options.reference_scale, options.guidance_until).float())
    return torch.cat(out)


def generate(nets: KeySyncNetworks, schedule: Schedule, inputs: Inputs, options: KeySyncOptions,
             check: Callable[[], None] | None = None) -> Iterator[tuple[int, torch.Tensor]]:
    """(first frame index, [n, 3, 512, 512] frames in [0, 1]) chunk after chunk, up to schedule.frames.
    `check()` runs before every UNet call's clips (a chunk takes minutes): whatever it raises stops here."""
    check = check or (lambda: None)
    device = inputs.latents.device
    generator = torch.Generator(device).manual_seed(options.seed)
    key_dtype, inter_dtype = (getattr(torch, d) for d in (options.keyframe_dtype, options.interpolation_dtype))
    latent_shape = inputs.latents.shape[1:]
    decode_dtype = getattr(torch, options.decode_dtype)
    vae = nets.cast(nets.vae, decode_dtype)
    identity = inputs.latents[:1].float()
    carried, held, done = None, None, 0  # the last keyframe's latent; the last frame, held back, and its index
    with torch.inference_mode():
        for chunk in schedule.chunks:
            slots = [s for clip in chunk.clips for s in clip]
            frames = torch.tensor([s.frame for s in slots], device=device)
            noise = torch.cat([torch.randn((CLIP, *latent_shape), generator=generator, device=device)
                               for _ in chunk.clips])
            clips = len(chunk.clips)
            cond = Conditions(inputs.keyframe_speech[frames].unflatten(0, (clips, CLIP)), inputs.latents[frames],
                              inputs.masks[frames], identity.expand(clips, *latent_shape))
            keyframes = _sample_in_calls(nets, nets.keyframe, cond, noise, options, key_dtype, check)
            kept = [keyframes[i] for i, s in enumerate(slots) if s.kept]
            if carried is not None:
                kept.insert(0, carried)
            carried = keyframes[-1]
            segments = len(chunk.segments)
            starts = torch.tensor([a for a, _ in chunk.segments], device=device)
            index = (starts[:, None] + torch.arange(CLIP, device=device)[None]).flatten()
            ends = torch.stack([torch.stack(kept[:segments]), torch.stack(kept[1:segments + 1])], dim=1)
            noise = torch.randn((CLIP * segments, *latent_shape), generator=generator, device=device)
            cond = Conditions(inputs.interpolation_speech[index].unflatten(0, (segments, CLIP)),
                              inputs.latents[index], inputs.masks[index], ends)
            z = _sample_in_calls(nets, nets.interpolation, cond, noise, options, inter_dtype, check).unflatten(
                0, (segments, CLIP))
            z[:, 0], z[:, -1] = ends[:, 0], ends[:, 1]
            z = z.flatten(0, 1) / SCALE  # decoded a clip at a time: the 512x512 decoder's activations are large
            pixels = torch.cat([vae.decode(z[i:i + CLIP].to(decode_dtype), frames=1).float()
                                for i in range(0, z.shape[0], CLIP)])
            video = _merge(((pixels + 1.0) / 2.0).clamp(0.0, 1.0).unflatten(0, (segments, CLIP)))
            first = chunk.segments[0][0]  # the frame held back from the chunk before: this chunk's version is kept
            yield first, video[:-1]
            held, done = video[-1:], first + video.shape[0] - 1
    if held is not None:
        yield done, held


def _merge(segments: torch.Tensor) -> torch.Tensor:
    """[S, CLIP, ...] segments sharing their end frames -> [1 + S * STEP, ...], each shared frame averaged."""
    s = segments.shape[0]
    out = torch.zeros((1 + s * STEP, *segments.shape[2:]), dtype=segments.dtype, device=segments.device)
    count = torch.zeros(1 + s * STEP, dtype=segments.dtype, device=segments.device)
    for i in range(s):
        out[i * STEP:i * STEP + CLIP] += segments[i]
        count[i * STEP:i * STEP + CLIP] += 1
    return out / count.view(-1, *[1] * (segments.ndim - 2))
