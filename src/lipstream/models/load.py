"""Load MuseTalk v1.5 from a models folder in the upstream layout, or build it with random weights."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lipstream.errors import WeightsError
from lipstream.models import build
from lipstream.models.checkpoint import (
    fingerprint, load_strict, read_json, read_state_dict, rename_old_vae_attention)
from lipstream.models.config import RANDOM_WARNING  # noqa: F401  (re-exported)
from lipstream.models.config import (
    AUDIO_DIM, HIDDEN_STATES, N_FFT, HOP_LENGTH, N_MELS, SAMPLE_RATE, SEGMENT_SECONDS, ModelConfig, model_config)
from lipstream.models.layout import HOW_TO_GET, UNET_DIR, VAE_DIR, WHISPER_DIR, find, models_dir, upstream_file
from lipstream.models.positional import PositionalEncoding
from lipstream.models.unet import UNet
from lipstream.models.dwpose import DWPOSE_SIZES, DWPose
from lipstream.models.vae import VAE
from lipstream.models.whisper import WhisperEncoder, mel_filters

log = logging.getLogger(__name__)

COMPONENTS = ("unet", "vae", "whisper")

@dataclass
class MuseTalk:
    """The networks of one MuseTalk v1.5 model set, on one device in one dtype."""

    config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    pe: PositionalEncoding
    unet: UNet | None = None
    vae: VAE | None = None
    whisper: WhisperEncoder | None = None
    random_weights: bool = False
    source: str = ""
    fingerprints: dict[str, str] = field(default_factory=dict)
    mel_filters: np.ndarray = field(default_factory=mel_filters, repr=False)  # [201, 80], audio.features

    def whisper_states(self, mel: torch.Tensor) -> torch.Tensor:
        """[S, 80, 3000] -> [S, 1500, 5, 384]: every hidden state of the Whisper encoder, stacked."""
        return self.whisper(mel)


def default_dtype(device: torch.device) -> torch.dtype:
    """fp16 on CUDA (what MuseTalk runs in), fp32 elsewhere."""
    return torch.float16 if device.type == "cuda" else torch.float32


def load_musetalk(
    models: str | Path | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    components: Iterable[str] = COMPONENTS,
    random_weights: bool = False,
    size: str = "full",
    seed: int = 0,
    warn: bool = True,
) -> MuseTalk:
    """MuseTalk networks ready for inference.

    With `random_weights`, the `size` preset ("full" or "tiny") is built with seeded random
    weights and nothing is read from disk; otherwise every requested component is loaded strictly
    from `models` (or $LIPSTREAM_MODELS, or ~/.cache/lipstream/models). `warn=False` is for
    callers that have already told the user about random weights in their own way.
    """
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    wanted = set(components)
    unknown = wanted - set(COMPONENTS)
    if unknown:
        raise ValueError(f"unknown components {sorted(unknown)}; choose from {COMPONENTS}")
    if random_weights:
        if warn:
            log.warning(RANDOM_WARNING)
        m = _random(model_config(size), wanted, device, seed)
    else:
        m = _from_folder(models_dir(models), wanted)
    m.device, m.dtype = device, dtype
    for name in COMPONENTS:
        net = getattr(m, name)
        if net is not None:
            setattr(m, name, net.to(device=device, dtype=dtype))
    m.pe = m.pe.to(device)
    return m


def _random(config: ModelConfig, wanted: set[str], device: torch.device, seed: int) -> MuseTalk:
    m = MuseTalk(config=config, device=device, dtype=torch.float32, pe=PositionalEncoding(), random_weights=True, source=f"random weights ({config.name}, seed {seed})")
    builders = {"unet": (build.build_unet, config.unet), "vae": (build.build_vae, config.vae),
                "whisper": (build.build_whisper_encoder, config.whisper)}
    for offset, name in enumerate(COMPONENTS):
        if name in wanted:
            make, cfg = builders[name]
            net = make(cfg, device=device, seed=seed + offset)
            setattr(m, name, net)
            m.fingerprints[name] = fingerprint(net.state_dict())
    return m


def missing_message(root: Path, rel: str) -> str:
    alternatives = upstream_file(rel).alternatives
    also = f" (or {', '.join(str(root / a) for a in alternatives)})" if alternatives else ""
    return f"missing {root / rel}{also}; {HOW_TO_GET}"


def _require(root: Path, rel: str) -> Path:
    path = find(root, rel)
    if path is None:
        raise WeightsError(missing_message(root, rel))
    return path


def _from_folder(root: Path, wanted: set[str]) -> MuseTalk:
    if not root.is_dir():
        raise WeightsError(f"models folder {root} does not exist; {HOW_TO_GET}")
    unet_cfg = read_json(_require(root, f"{UNET_DIR}/musetalk.json")) if "unet" in wanted else {}
    vae_cfg = read_json(_require(root, f"{VAE_DIR}/config.json")) if "vae" in wanted else {}
    whisper_cfg = read_json(_require(root, f"{WHISPER_DIR}/config.json")) if "whisper" in wanted else {}
    if "whisper" in wanted:
        check_preprocessor(root)
    m = MuseTalk(config=ModelConfig(f"folder:{root}", unet_cfg, vae_cfg, whisper_cfg), device=torch.device("cpu"),
                 dtype=torch.float32, pe=PositionalEncoding(), source=str(root))
    if "unet" in wanted:
        m.unet, m.fingerprints["unet"] = load_unet(root, unet_cfg)
    if "vae" in wanted:
        m.vae, m.fingerprints["vae"] = load_vae(root, vae_cfg)
    if "whisper" in wanted:
        m.whisper, m.fingerprints["whisper"] = load_whisper_encoder(root, whisper_cfg)
    return m


def load_unet(root: Path, cfg: dict) -> tuple[UNet, str]:
    path = _require(root, f"{UNET_DIR}/unet.pth")
    sd = read_state_dict(path)
    unet = _construct(build.build_unet, cfg, root / UNET_DIR / "musetalk.json")
    load_strict(unet, sd, path)
    return unet, fingerprint(sd)


def load_vae(root: Path, cfg: dict) -> tuple[VAE, str]:
    path = _require(root, f"{VAE_DIR}/diffusion_pytorch_model.safetensors")
    sd = rename_old_vae_attention(read_state_dict(path))
    vae = _construct(build.build_vae, cfg, root / VAE_DIR / "config.json")
    load_strict(vae, sd, path)
    return vae, fingerprint(sd)


def load_whisper_encoder(root: Path, cfg: dict) -> tuple[WhisperEncoder, str]:
    """Only the encoder of the HF checkpoint (keys `model.encoder.*` or `encoder.*`): MuseTalk never decodes."""
    path = _require(root, f"{WHISPER_DIR}/model.safetensors")
    sd = read_state_dict(path)
    encoder_sd = {}
    for prefix in ("model.encoder.", "encoder."):
        encoder_sd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
        if encoder_sd:
            break
    if not encoder_sd:
        raise WeightsError(f"{path}: holds no Whisper encoder tensors (no 'model.encoder.*' keys); {HOW_TO_GET}")
    encoder = _construct(build.build_whisper_encoder, cfg, root / WHISPER_DIR / "config.json")
    if encoder.config.d_model != AUDIO_DIM or encoder.config.encoder_layers + 1 != HIDDEN_STATES \
            or encoder.config.num_mel_bins != N_MELS:
        raise WeightsError(f"{root / WHISPER_DIR / 'config.json'}: MuseTalk v1.5 needs whisper-tiny "
                           f"(d_model {AUDIO_DIM}, 4 layers), found d_model {encoder.config.d_model}, "
                           f"{encoder.config.encoder_layers} layers")
    load_strict(encoder, encoder_sd, path)
    return encoder, fingerprint(encoder_sd)


# What WhisperFeatureExtractor assumes where preprocessor_config.json leaves a key out.
PREPROCESSOR_DEFAULTS = {"feature_size": N_MELS, "sampling_rate": SAMPLE_RATE, "n_fft": N_FFT,
                         "hop_length": HOP_LENGTH, "chunk_length": SEGMENT_SECONDS}


def check_preprocessor(root: Path) -> None:
    """preprocessor_config.json must describe whisper-tiny's log-mel (what audio/features.py computes)."""
    path = _require(root, f"{WHISPER_DIR}/preprocessor_config.json")
    cfg = read_json(path)
    got = {k: cfg.get(k, v) for k, v in PREPROCESSOR_DEFAULTS.items()}
    if got != PREPROCESSOR_DEFAULTS:
        keys = ", ".join(PREPROCESSOR_DEFAULTS)
        raise WeightsError(f"{path}: expected whisper-tiny's ({keys}) = {tuple(PREPROCESSOR_DEFAULTS.values())}, "
                           f"found {tuple(got.values())}")


def _construct(make, cfg: dict, config_path: Path):
    try:
        return make(cfg)
    except Exception as e:
        raise WeightsError(f"{config_path}: cannot build the model from this config ({e}); {HOW_TO_GET}") from None


def load_dwpose(path: str | Path, *, size: str = "auto", device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> DWPose:
    """The network from `dw-ll_ucoco_384.pth` as upstream ships it (an mmengine checkpoint, read with a
    restricted unpickler) or a .safetensors of the same keys; strict: every key and shape, WeightsError else.
    `size` "auto": the preset whose stem has the file's width (upstream's file is "full")."""
    path = Path(path)
    sd = read_state_dict(path, restricted=True)
    if size == "auto":
        stem = sd.get("backbone.stem.0.conv.weight")
        sizes = [name for name, c in DWPOSE_SIZES.items() if stem is not None and stem.shape[0] * 2 == c.widths[0]]
        size = sizes[0] if sizes else "full"  # no match: the strict load below names what differs
    net = build.build_dwpose(size)
    load_strict(net, sd, path)
    return net.to(device=device, dtype=dtype)
