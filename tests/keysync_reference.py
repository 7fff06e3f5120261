"""The reference for models/keysync.py and keysync/: KeySync's own `sgm` code (antonibigata/keysync), imported
from a checkout named by $LIPSTREAM_KEYSYNC_REFERENCE (the folder that holds `sgm/`).

KeySync is not on PyPI, so a fresh machine has no copy: the tests that need one skip there, and those against
diffusers' SVD blocks still run. The sgm packages' own __init__ files (Lightning, the training stack) are
skipped, and the third-party modules its files import only for other paths (moviepy, kornia, open_clip,
omegaconf, torchaudio, ...) are stand-ins for the import alone. The released configs attend through
xformers (`softmax-xformers`; sgm's plain `softmax` class fails on a batch without its skip mask): xformers'
`memory_efficient_attention` is given here as PyTorch's scaled_dot_product_attention (the same sums).
Needs einops (the test extra).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path

ENV_VAR = "LIPSTREAM_KEYSYNC_REFERENCE"
# imported only for code paths the tests do not run
STAND_INS = ("fsspec", "torchaudio", "torchvision", "moviepy", "moviepy.editor", "omegaconf", "kornia", "open_clip",
             "facenet_pytorch", "insightface", "insightface.app", "pytorch_lightning", "lightning", "clint",
             "clint.textui", "requests", "fire", "torchvision.io", "transformers", "diffusers", "diffusers.utils",
             "diffusers.models", "diffusers.models.modeling_utils")


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def _xformers() -> tuple[types.ModuleType, types.ModuleType]:
    """xformers.ops.memory_efficient_attention over [N, L, K] queries, keys and values: softmax(q k^T / sqrt(K)) v
    (on a GPU, by the same fused kernels as xformers': a fair stand-in for the reference's speed too)."""
    xformers, ops = types.ModuleType("xformers"), types.ModuleType("xformers.ops")
    xformers.__version__ = "0.0.28"
    xformers.ops = ops

    def memory_efficient_attention(q, k, v, attn_bias=None, op=None):
        assert attn_bias is None
        import torch.nn.functional as F

        return F.scaled_dot_product_attention(q, k, v)  # softmax(q k^T / sqrt(K)) v, by PyTorch's kernels

    ops.memory_efficient_attention = memory_efficient_attention
    return xformers, ops


def checkout() -> Path | None:
    """The checkout named by $LIPSTREAM_KEYSYNC_REFERENCE, where it holds sgm/ and einops is installed."""
    root = os.environ.get(ENV_VAR)
    if not root or not (Path(root) / "sgm" / "modules").is_dir() or importlib.util.find_spec("einops") is None:
        return None
    return Path(root)


def load(*names: str) -> list[types.ModuleType] | None:
    """The named sgm modules (e.g. "sgm.modules.diffusionmodules.video_model"), or None without a checkout."""
    root = checkout()
    if root is None:
        return None
    for probing in ("diffusers.utils", "diffusers.models.modeling_utils", "transformers"):
        if importlib.util.find_spec(probing.split(".")[0]) is not None:  # (stand-ins where absent: a GPU image)
            importlib.import_module(probing)  # before the stand-ins: these look up which packages exist as they load
    added, path = [], list(sys.path)
    for name in STAND_INS:
        top = name.split(".")[0]
        if name not in sys.modules and (top in added or importlib.util.find_spec(top) is None):
            sys.modules[name] = _StandIn(name)
            added.append(name)
    if "xformers" not in sys.modules and importlib.util.find_spec("xformers") is None:
        sys.modules["xformers"], sys.modules["xformers.ops"] = _xformers()
        added += ["xformers", "xformers.ops"]
    try:
        # sgm's and sgm.modules' __init__ files import the training stack; scripts/ has none
        for package in ("sgm", "sgm.modules", "scripts", "scripts.util", "scripts.util.audio"):
            if package not in sys.modules:
                module = types.ModuleType(package)
                module.__path__ = [str(root / package.replace(".", "/"))]
                sys.modules[package] = module
        return [importlib.import_module(name) for name in names]
    finally:
        for name in added:
            sys.modules.pop(name, None)
        sys.path[:] = path  # the pipeline script appends the checkout to it


# --- what the tests run on both sides: weights and inputs made from seeds, so the reference's outputs can be
# stored (tests/data/keysync_reference.safetensors, written by tests/keysync_golden.py) and checked without it

def seeded(state: dict, seed: int = 0, scale: float = 0.1) -> dict:
    """Random weights for a state dict, each drawn from its own name: the same on any network with these names."""
    import zlib

    import torch

    return {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(seed + zlib.crc32(k.encode()))) * scale
            for k, v in state.items()}


def inputs(kind: str, clips: int = 2, frames: int = 4, size: int = 8, features: int = 24) -> dict:
    """Seeded inputs for a tiny `kind` ("keyframe" or "interpolation") network: UNet inputs and sampling conditions."""
    import torch

    g = torch.Generator().manual_seed(1 if kind == "keyframe" else 2)
    n = clips * frames
    mask = torch.zeros(n, 1, size, size)
    mask[:, :, size // 2:, 1:-1] = 1.0  # the lower face
    reference = (torch.randn(clips, 4, size, size, generator=g) if kind == "keyframe"
                 else torch.randn(clips, 2, 4, size, size, generator=g))
    return {"x": torch.randn(n, 9 if kind == "interpolation" else 8, size, size, generator=g),
            "c_noise": torch.randn(n, generator=g), "audio": torch.randn(clips, frames, 24, generator=g),
            "speech": torch.randn(clips, frames, 2, features, generator=g),
            "latents": torch.randn(n, 4, size, size, generator=g), "mask": mask, "reference": reference,
            "noise": torch.randn(n, 4, size, size, generator=g)}


def unet(config):
    """sgm's VideoUNet as KeySync's yaml builds it, at `config`'s shapes."""
    video_model, = load("sgm.modules.diffusionmodules.video_model")
    c = config
    return video_model.VideoUNet(
        in_channels=c.in_channels, out_channels=c.out_channels, model_channels=c.model_channels,
        attention_resolutions=list(c.attention_resolutions), num_res_blocks=c.num_res_blocks,
        channel_mult=list(c.channel_mult), num_head_channels=c.num_head_channels, context_dim=c.context_dim,
        adm_in_channels=0, num_classes="sequential", use_checkpoint=False, use_linear_in_transformer=True,
        transformer_depth=1, spatial_transformer_attn_type="softmax-xformers", extra_ff_mix_layer=True,
        use_spatial_context=True, merge_strategy="learned_with_images", video_kernel_size=[3, 1, 1],
        fine_tuning_method=None, audio_cond_method="both_keyframes", additional_audio_frames=0,
        audio_dim=c.audio_dim).eval()


def run_unet(network, x, c_noise, audio):
    """The reference UNet's output: each frame's context is its clip's speech tokens, as the wrapper passes them."""
    clips, frames = audio.shape[:2]
    return network(x, c_noise, context=audio, num_video_frames=frames,
                   image_only_indicator=x.new_zeros(clips, frames))


def sampling(config, speech_dim: int, steps: int = 10, device: str = "cpu"):
    """The reference's sampling objects as its yaml builds them (DenoiserDub, the Euler sampler over the AYS
    table, the speech/reference guider at 5 and 2, the wrapper and speech embedder), randomly initialised
    on `device`: (network, embedder, wrapper, run); run(speech, latents, mask, reference, noise) samples."""
    import torch

    wrappers, denoiser, sampling_, encoders = load(
        "sgm.modules.diffusionmodules.wrappers", "sgm.modules.diffusionmodules.denoiser",
        "sgm.modules.diffusionmodules.sampling", "sgm.modules.encoders.modules")
    interpolation = config.in_channels == 9
    with torch.device(device):  # made (and randomly initialised) there: 1.5 G parameters take minutes on a CPU
        network = unet(config).to(device)
        embedder = encoders.WhisperAudioEmbedder(merge_method="mean", linear_dim=config.context_dim,
                                                 cond_type="crossattn", audio_dim=speech_dim).to(device)
    dub = denoiser.DenoiserDub({"target": "sgm.modules.diffusionmodules.denoiser_scaling.VScalingWithEDMcNoise"},
                               mask_input=True)
    sampler = sampling_.EulerEDMSampler(
        discretization_config={"target": "sgm.modules.diffusionmodules.discretizer.AYSDiscretization"},
        num_steps=steps, verbose=False, device=device,
        guider_config={"target": "sgm.modules.diffusionmodules.guiders.AudioRefMultiCondGuider",
                       "params": {"audio_ratio": 5.0, "ref_ratio": 2.0}})

    def run(speech, latents, mask, reference, noise):
        size = latents.shape[-1]
        wrapper = (wrappers.InterpolationWrapper(network, im_size=[8 * size, 8 * size], n_channels=4,
                                                 starting_mask_method="zeros", add_mask=True).to(device)
                   if interpolation else wrappers.DubbingWrapper(network, mask_input=True))
        if interpolation and run.learned_mask is not None:
            wrapper.learned_mask.data.copy_(run.learned_mask)
        clips, frames = speech.shape[:2]
        concat = (reference.flatten(1, 2) if interpolation else reference) / 0.18215
        with torch.no_grad():
            c = {"crossattn": embedder(speech), "concat": concat, "gt": latents, "masks": mask}
            uc = {"crossattn": torch.zeros_like(c["crossattn"]), "concat": torch.zeros_like(concat), "gt": latents,
                  "masks": mask}
            extra = {"image_only_indicator": torch.zeros(3 * clips, frames, device=device), "num_video_frames": frames}
            return sampler(lambda x, sigma, cond: dub(wrapper, x, sigma, cond, **extra), noise.clone(), cond=c, uc=uc)

    run.learned_mask = None  # the interpolation wrapper's, once loaded (else its own initial value)
    return network, embedder, run


def sample(config, state: dict, speech, latents, mask, reference, noise, steps: int = 10):
    """The reference sampling run (as `sampling` builds it) on checkpoint-named weights `state`."""
    network, embedder, run = sampling(config, speech.shape[-1], steps)
    prefix = "model.diffusion_model."
    network.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}, strict=True)
    embedder.load_state_dict({"linear." + k.rsplit(".", 1)[1]: v for k, v in state.items()
                              if k.startswith("conditioner.embedders.2.")}, strict=True)
    if "model.learned_mask" in state:
        run.learned_mask = state["model.learned_mask"]
    return run(speech, latents, mask, reference, noise)


WAVLM_CONFIG = {"encoder_layers": 2, "encoder_embed_dim": 64, "encoder_ffn_embed_dim": 96, "encoder_attention_heads": 4,
                "conv_feature_layers": "[(32,10,5)] + [(32,3,2)] * 4 + [(32,2,2)] * 2", "conv_pos": 16,
                "conv_pos_groups": 4, "relative_position_embedding": True, "num_buckets": 320, "max_distance": 800,
                "gru_rel_pos": True, "layer_norm_first": False, "extractor_mode": "default", "normalize": False,
                "dropout": 0.0}  # a tiny WavLM of Base+'s kind


def wavlm_state(names: dict) -> dict:
    """Seeded weights for a tiny WavLM, the distance bias larger so that a wrong bucket shows."""
    state = seeded(names, seed=3, scale=0.2)
    state["encoder.layers.0.self_attn.relative_attention_bias.weight"] *= 10
    return state


def wavlm_speech(seconds: float = 3.0):
    import torch

    return torch.randn(int(16000 * seconds), generator=torch.Generator().manual_seed(4))


def wavlm(state: dict):
    """The reference WavLM (scripts/util/audio/WavLM.py) at WAVLM_CONFIG with `state`."""
    module, = load("scripts.util.audio.WavLM")
    network = module.WavLM(module.WavLMConfig(WAVLM_CONFIG)).eval()
    network.load_state_dict(state, strict=True)
    return network


SGM_DECODER = {"attn_type": "vanilla", "double_z": True, "z_channels": 4, "resolution": 64, "in_channels": 3,
               "out_ch": 3, "ch": 32, "ch_mult": [1, 1, 2, 2], "num_res_blocks": 2, "attn_resolutions": [],
               "dropout": 0.0, "video_kernel_size": [3, 1, 1]}  # KeySync's VideoDecoder, narrow
SGM_DECODER_SHAPES = Path(__file__).parent / "data" / "sgm_decoder_shapes.json"


def sgm_decoder_state() -> dict:
    """Seeded weights under sgm's VideoDecoder names (their list stored beside the outputs: no checkout needed)."""
    import json

    import torch

    shapes = json.loads(SGM_DECODER_SHAPES.read_text())
    return seeded({k: torch.empty(v) for k, v in shapes.items()}, seed=5, scale=0.2)


def sgm_decoder():
    """The checkout's VideoDecoder at SGM_DECODER."""
    temporal_ae, = load("sgm.modules.autoencoding.temporal_ae")
    return temporal_ae.VideoDecoder(**SGM_DECODER).eval()
