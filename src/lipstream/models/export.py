"""Write a model set in exactly the upstream download layout (for tests, demos and benchmarks).

The files are what users download: `musetalkV15/unet.pth` (a torch-saved state dict with
diffusers key names) + `musetalk.json`; `sd-vae/` as diffusers saves an AutoencoderKL; `whisper/`
as transformers saves WhisperForConditionalGeneration, plus `preprocessor_config.json`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

from lipstream.models import build
from lipstream.models.config import model_config
from lipstream.models.layout import UNET_DIR, VAE_DIR, WHISPER_DIR


def write_random_checkpoint(root: str | Path, *, size: str = "tiny", seed: int = 0, binary: bool = True) -> Path:
    """Seeded random weights saved in the upstream layout under `root`.

    `binary=True` writes the legacy formats upstream ships (unet.pth, diffusion_pytorch_model.bin,
    pytorch_model.bin); `False` writes safetensors where upstream also offers them.
    """
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    root = Path(root)
    config = model_config(size)
    for sub in (UNET_DIR, VAE_DIR, WHISPER_DIR):
        (root / sub).mkdir(parents=True, exist_ok=True)

    unet = build.build_unet(config.unet, device="cpu", seed=seed)
    (root / UNET_DIR / "musetalk.json").write_text(json.dumps(config.unet, indent=2))
    sd = {k: v.contiguous() for k, v in unet.state_dict().items()}
    if binary:
        torch.save(sd, root / UNET_DIR / "unet.pth")
    else:
        from safetensors.torch import save_file

        save_file(sd, str(root / UNET_DIR / "unet.safetensors"))

    vae = build.build_vae(config.vae, device="cpu", seed=seed + 1)
    vae.save_pretrained(root / VAE_DIR, safe_serialization=not binary)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 2)
        whisper = WhisperForConditionalGeneration(build.whisper_config(config.whisper)).eval()
    whisper.save_pretrained(root / WHISPER_DIR)  # config.json + model.safetensors
    if binary:  # openai/whisper-tiny ships pytorch_model.bin: same keys, torch-saved
        (root / WHISPER_DIR / "model.safetensors").unlink()
        torch.save({k: v.contiguous() for k, v in whisper.state_dict().items()},
                   root / WHISPER_DIR / "pytorch_model.bin")
    WhisperFeatureExtractor().save_pretrained(root / WHISPER_DIR)
    return root
