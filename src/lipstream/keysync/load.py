"""KeySync's networks: from the published files, key for key and strict, or seeded random ones of the published
shapes ("full", for speed) or tiny ones (CPU tests)."""

from __future__ import annotations

from pathlib import Path

import torch

from lipstream.errors import WeightsError
from lipstream.keysync.engine import KeySyncModels
from lipstream.keysync.pipeline import KeySyncNetworks
from lipstream.models.checkpoint import load_strict, read_json, read_restricted, read_state_dict
from lipstream.models.hubert import HuBERT, HuBERTConfig
from lipstream.models.keysync import INTERPOLATION, KEYFRAME, TINY, KeySyncNet, KeySyncUNetConfig
from lipstream.models.svd_vae import SVDVAE, SVDVAEConfig, decoder_from_sgm
from lipstream.models.layout import HOW_TO_GET, KEYSYNC_DIR, KEYSYNC_FILES
from lipstream.models.wavlm import WavLM, WavLMConfig

SIZES = ("full", "tiny")
TINY_SPEECH = 64  # the tiny encoders' token width
TINY_SIZE = 128  # the tiny networks' square (the published ones see 512)
DECODER = "first_stage_model.decoder."  # the VAE decoder in KeySync's checkpoints, under sgm's names
TINY_HUBERT = HuBERTConfig(hidden_size=TINY_SPEECH, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                           conv_dim=(32,) * 7, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
TINY_WAVLM = WavLMConfig(encoder_layers=1, encoder_embed_dim=TINY_SPEECH, encoder_ffn_embed_dim=64,
                         encoder_attention_heads=4, conv_feature_layers="[(32,10,5)] + [(32,3,2)] * 4 + [(32,2,2)] * 2",
                         conv_pos=16, conv_pos_groups=4)
TINY_VAE = SVDVAEConfig(block_out_channels=(32,) * 4, layers_per_block=1)


def random_vae(size: str, device: torch.device | str, seed: int = 0) -> SVDVAE:
    """random_keysync's SVD VAE alone (drawn from its own seed: `compile --keysync` makes the same one)."""
    with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []), torch.device(device):
        torch.manual_seed(seed + 1)
        return SVDVAE(SVDVAEConfig() if size == "full" else TINY_VAE).eval().requires_grad_(False)


def load_svd_vae(root: Path, device: torch.device | str) -> SVDVAE:
    """The SVD VAE from its own files in the models folder (its encoder is what KeySync's latents need)."""
    from lipstream.models.load import _require

    files = [_require(root, f.path) for f in KEYSYNC_FILES[5:7]]
    vae = _from_config(lambda cfg: SVDVAE(SVDVAEConfig.from_dict(cfg)), files[0], files[1]).float()
    return vae.to(device)


def random_keysync(size: str, device: torch.device | str, seed: int = 0) -> KeySyncModels:
    """KeySync's five networks with weights drawn from `seed` on `device`: "full" has the published shapes
    (for speed), "tiny" the same classes, narrow and shallow (for CPU tests). They are not a lip-sync model."""
    if size not in SIZES:
        raise ValueError(f"random size {size!r}: one of {', '.join(SIZES)}")
    device = torch.device(device)
    full = size == "full"
    (keyframe, features, latent), (interpolation, _, _) = _shapes(size, False), _shapes(size, True)
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), device:
        torch.manual_seed(seed)
        unets = KeySyncNet(keyframe, features, latent), KeySyncNet(interpolation, features, latent)
        nets = KeySyncNetworks(*unets, random_vae(size, device, seed))
        with torch.no_grad():  # the learned latent between keyframes starts at zeros: give it values
            nets.interpolation.model.learned_mask.normal_(0.0, 0.5)
        hubert = HuBERT(HuBERTConfig() if full else TINY_HUBERT)
        wavlm = WavLM(WavLMConfig() if full else TINY_WAVLM)
    for m in (nets.keyframe, nets.interpolation, nets.vae, hubert, wavlm):
        m.eval().requires_grad_(False)
    return KeySyncModels(nets, hubert, wavlm, device, 512 if full else TINY_SIZE,
                         note=f"KeySync: {size} random networks (seed {seed})")


# --- the published files (models/layout.py's KEYSYNC_FILES), key for key

def read_keysync_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The tensors of a KeySync `.pt` as its training saved it (a DeepSpeed/Lightning dict: the weights under
    "module", named `_forward_module.<name>`), read with the restricted unpickler: no code in the file runs.
    Returns (the UNet's and speech projection's tensors, the VAE decoder's under sgm's names). Dropped:
    the VAE's encoder and `conditioner.embedders.0.*` (an image encoder the reference builds and never runs:
    its frames come in as latents)."""
    raw = read_restricted(path)
    sd = raw.get("module", raw.get("state_dict", raw)) if isinstance(raw, dict) else None
    if not isinstance(sd, dict):
        raise WeightsError(f"{path}: not a KeySync checkpoint (no 'module' or 'state_dict' of tensors); {HOW_TO_GET}")
    sd = {k.removeprefix("_forward_module."): v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    decoder = {k.removeprefix(DECODER): v for k, v in sd.items() if k.startswith(DECODER)}
    unused = ("first_stage_model.", "conditioner.embedders.0.")
    return {k: v for k, v in sd.items() if not k.startswith(unused)}, decoder


def load_keysync_net(path: Path, interpolation: bool, size: str = "full",
                     sd: dict[str, torch.Tensor] | None = None) -> KeySyncNet:
    """One KeySync checkpoint (or its tensors `sd`, read already); the file's input width says which model it
    is (8: keyframes, 9: the frames between). `size` "tiny": the test networks' shapes (random_keysync's),
    written in the same format."""
    sd = read_keysync_checkpoint(path)[0] if sd is None else sd
    conv = sd.get("model.diffusion_model.input_blocks.0.0.weight")
    if conv is None or conv.ndim != 4 or conv.shape[1] not in (8, 9):
        raise WeightsError(f"{path}: not a KeySync UNet checkpoint (no model.diffusion_model.input_blocks.0.0 of 8 "
                           f"or 9 input channels); {HOW_TO_GET}")
    if (conv.shape[1] == 9) != interpolation:
        found, wanted = ("interpolation", "keyframe") if conv.shape[1] == 9 else ("keyframe", "interpolation")
        raise WeightsError(f"{path}: holds the {found} model, not the {wanted} one")
    config, features, latent = _shapes(size, interpolation)
    with torch.device("meta"):
        net = KeySyncNet(config, features, latent)
    load_strict(net, sd, path)
    return net.eval().requires_grad_(False)


def _shapes(size: str, interpolation: bool) -> tuple[KeySyncUNetConfig, int, int]:
    """(UNet config, speech feature width, latent size) of a size."""
    if size == "full":
        return (INTERPOLATION if interpolation else KEYFRAME), 768, 64
    config = KeySyncUNetConfig(**{**TINY.to_dict(), "in_channels": 9}) if interpolation else TINY
    return config, TINY_SPEECH, TINY_SIZE // 8


def load_wavlm(path: Path) -> WavLM:
    """WavLM-Base+.pt: {"cfg": its settings, "model": its weights}."""
    raw = read_restricted(path)
    if not isinstance(raw, dict) or not isinstance(raw.get("cfg"), dict) or not isinstance(raw.get("model"), dict):
        raise WeightsError(f"{path}: not a WavLM checkpoint (expected 'cfg' and 'model'); {HOW_TO_GET}")
    try:
        config = WavLMConfig.from_dict(raw["cfg"])
    except (ValueError, TypeError) as e:
        raise WeightsError(f"{path}: {e}; {HOW_TO_GET}") from None
    with torch.device("meta"):
        net = WavLM(config)
    load_strict(net, {k: v for k, v in raw["model"].items() if isinstance(v, torch.Tensor)}, path)
    return net.eval().requires_grad_(False)


def _from_config(make, config_path: Path, weights: Path):
    try:
        with torch.device("meta"):
            net = make(read_json(config_path))
    except (ValueError, TypeError) as e:
        raise WeightsError(f"{config_path}: cannot build the model from this config ({e}); {HOW_TO_GET}") from None
    load_strict(net, read_state_dict(weights), weights)
    return net.eval().requires_grad_(False)


def load_keysync(root: Path, device: torch.device | str, size: str = "full") -> KeySyncModels:
    """KeySync's five networks from the models folder (`lipstream weights download --model keysync`); a
    WeightsError naming the first missing or mismatched file. `size` "tiny": test files of random_keysync's
    tiny UNets (the other networks take their shapes from their configs)."""
    from lipstream.models.load import _require

    if not root.is_dir():
        raise WeightsError(f"models folder {root} does not exist; {HOW_TO_GET}")
    paths = {f.path: _require(root, f.path) for f in KEYSYNC_FILES}  # every file there before any is read
    files = [paths[f.path] for f in KEYSYNC_FILES]
    keyframe = load_keysync_net(files[0], interpolation=False, size=size)
    tensors, decoder = read_keysync_checkpoint(files[1])
    interpolation = load_keysync_net(files[1], interpolation=True, size=size, sd=tensors)
    wavlm = load_wavlm(files[2])
    hubert = _from_config(lambda cfg: HuBERT(HuBERTConfig.from_dict(cfg)), files[3], files[4])
    vae = _from_config(lambda cfg: SVDVAE(SVDVAEConfig.from_dict(cfg)), files[5], files[6]).float()
    if decoder:  # the decoder KeySync decodes its frames with: the interpolation checkpoint's own
        mapped = decoder_from_sgm(decoder, len(vae.config.block_out_channels))
        load_strict(vae.decoder, {k.removeprefix("decoder."): v.float() for k, v in mapped.items()}, files[1])
    device = torch.device(device)
    nets = KeySyncNetworks(keyframe.to(device), interpolation.to(device), vae.to(device))
    return KeySyncModels(nets, hubert.float().to(device), wavlm.float().to(device), device,
                         512 if size == "full" else TINY_SIZE, note=f"KeySync: weights from {root / KEYSYNC_DIR}")
