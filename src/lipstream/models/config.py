"""Architectures of the three MuseTalk v1.5 networks, as named presets.

`FULL` is exactly what upstream ships (musetalkV15/musetalk.json, stabilityai/sd-vae-ft-mse's
config.json, openai/whisper-tiny's config.json). `TINY` keeps the same classes and every shape
the pipeline depends on (8 -> 4 latent channels at 32x32, a VAE that scales by 8, Whisper with
80 mel bins, 1500 positions, d_model 384 and 4 layers = 5 hidden states), shrinking only widths
and depths so CPU tests run in seconds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

RANDOM_WARNING = ("RANDOM WEIGHTS: these networks are untrained. Output will not look like a mouth; "
                  "use it only to test the pipeline or measure speed.")

# Pipeline constants, named once.
SAMPLE_RATE = 16_000  # Whisper input, Hz
HOP_LENGTH = 160  # mel frames: 100 Hz
N_FFT = 400
N_MELS = 80
SEGMENT_SECONDS = 30
SEGMENT_SAMPLES = SEGMENT_SECONDS * SAMPLE_RATE  # 480_000
MEL_FRAMES = SEGMENT_SAMPLES // HOP_LENGTH  # 3000 per segment
FEATURE_RATE = 50  # encoder output steps per second (conv stride 2 over 100 Hz mel)
SAMPLES_PER_FEATURE = SAMPLE_RATE // FEATURE_RATE  # 320
FEATURES_PER_SEGMENT = SEGMENT_SECONDS * FEATURE_RATE  # 1500
AUDIO_DIM = 384  # whisper-tiny d_model = UNet cross_attention_dim
HIDDEN_STATES = 5  # embedding output + 4 encoder layers
WINDOW_FRAMES_LEFT = 2  # MuseTalk audio_padding_length_left
WINDOW_FRAMES_RIGHT = 2  # MuseTalk audio_padding_length_right
WINDOW_STEPS = 2 * (WINDOW_FRAMES_LEFT + WINDOW_FRAMES_RIGHT + 1)  # 10 feature steps per frame
WINDOW_TOKENS = WINDOW_STEPS * HIDDEN_STATES  # 50 tokens of 384 for the UNet
CROP_SIZE = 256  # face crop, pixels
LATENT_SIZE = CROP_SIZE // 8  # 32
LATENT_CHANNELS = 4
VAE_SCALING_FACTOR = 0.18215
UNET_TIMESTEP = 0
UPSAMPLE_MODES = ("transpose", "phases", "plain")  # how each nearest 2x upsample + 3x3 conv runs (blocks.py)

assert MEL_FRAMES == 3000 and FEATURES_PER_SEGMENT * 2 == MEL_FRAMES
assert SAMPLES_PER_FEATURE * FEATURE_RATE == SAMPLE_RATE

# musetalkV15/musetalk.json, verbatim.
UNET_FULL: dict[str, Any] = {
    "_class_name": "UNet2DConditionModel",
    "_diffusers_version": "0.6.0.dev0",
    "act_fn": "silu",
    "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 384,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 8,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "out_channels": 4,
    "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
}

# stabilityai/sd-vae-ft-mse config.json, verbatim (scaling_factor absent: diffusers' default 0.18215).
VAE_FULL: dict[str, Any] = {
    "_class_name": "AutoencoderKL",
    "_diffusers_version": "0.4.2",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "in_channels": 3,
    "latent_channels": 4,
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 256,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}

# openai/whisper-tiny: transformers' WhisperConfig defaults are whisper-tiny; these make it explicit.
WHISPER_FULL: dict[str, Any] = {
    "architectures": ["WhisperForConditionalGeneration"],
    "d_model": 384,
    "encoder_layers": 4,
    "encoder_attention_heads": 6,
    "encoder_ffn_dim": 1536,
    "decoder_layers": 4,
    "decoder_attention_heads": 6,
    "decoder_ffn_dim": 1536,
    "num_mel_bins": 80,
    "max_source_positions": 1500,
    "max_target_positions": 448,
    "vocab_size": 51865,
}

UNET_TINY: dict[str, Any] = {
    **UNET_FULL,
    "block_out_channels": [32, 64],
    "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
    "layers_per_block": 1,
    "norm_num_groups": 8,
    "sample_size": 32,
}

VAE_TINY: dict[str, Any] = {
    **VAE_FULL,
    "block_out_channels": [16, 32, 32, 32],
    "layers_per_block": 1,
    "norm_num_groups": 8,
}

WHISPER_TINY: dict[str, Any] = {
    **WHISPER_FULL,
    "encoder_ffn_dim": 384,
    "decoder_layers": 1,
    "decoder_ffn_dim": 64,
    "vocab_size": 128,
    "max_target_positions": 16,
    # Token ids must fit the tiny vocabulary (they are only used by the unused decoder).
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
    "suppress_tokens": [],
    "begin_suppress_tokens": [],
}


def check_keys(cfg: dict[str, Any], fixed: dict[str, Any], informational: set[str]) -> None:
    """A network's config.json holds only keys the network implements: ValueError naming the first other
    one. `fixed`: keys allowed only at these values (a list: any of its items); `informational`: keys read
    elsewhere or not at all; keys beginning with "_" are the saving library's own."""
    for key, value in cfg.items():
        if key.startswith("_") or key in informational:
            continue
        if key not in fixed:
            raise ValueError(f"unknown key {key!r}")
        want = fixed[key]
        if isinstance(want, list) and isinstance(value, list):
            ok = set(value) <= set(want)
        else:
            ok = value == want or (want is None and value in (None, [], 0))
        if not ok:
            raise ValueError(f"{key} {value!r} is not supported (only {want!r})")


@dataclass(frozen=True)
class ModelConfig:
    """The three architectures that make one MuseTalk v1.5 model set."""

    name: str
    unet: dict[str, Any] = field(repr=False)
    vae: dict[str, Any] = field(repr=False)
    whisper: dict[str, Any] = field(repr=False)


MODEL_SIZES: dict[str, ModelConfig] = {
    "full": ModelConfig("full", UNET_FULL, VAE_FULL, WHISPER_FULL),
    "tiny": ModelConfig("tiny", UNET_TINY, VAE_TINY, WHISPER_TINY),
}


def model_config(size: str) -> ModelConfig:
    """A deep copy of the networks' configuration at a size ("full", "tiny"), so callers may edit it freely."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; choose from {sorted(MODEL_SIZES)}")
    return copy.deepcopy(MODEL_SIZES[size])


def random_size_for(choice: str, device: str, avatar_meta: dict | None = None) -> str:
    """'auto' -> the size the avatar's random VAE had, else tiny on a CPU (a full-size frame takes seconds
    there) and full on a GPU; 'tiny' and 'full' as asked."""
    if choice != "auto":
        return choice
    made_with = ((avatar_meta or {}).get("vae") or {}).get("random")
    if made_with in ("tiny", "full"):
        return made_with
    return "tiny" if device == "cpu" else "full"
