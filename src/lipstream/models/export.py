"""Write a model set in exactly the upstream download layout (for tests, demos and benchmarks).

The files are what users download: `musetalkV15/unet.pth` (a torch-saved state dict with
diffusers' key names) + `musetalk.json`; `sd-vae/` as diffusers saves an AutoencoderKL (config.json
and the weights); `whisper/` as transformers saves a Whisper model (config.json, the weights under
`model.encoder.*`, preprocessor_config.json); `dwpose/dw-ll_ucoco_384.pth`, compile's face tracker, as an
mmengine checkpoint. Only Whisper's encoder is written: MuseTalk never runs Whisper's decoder, and
transformers initialises the missing decoder when it loads the folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lipstream.models import build
from lipstream.models.config import HOP_LENGTH, MEL_FRAMES, N_FFT, N_MELS, SAMPLE_RATE, SEGMENT_SAMPLES, SEGMENT_SECONDS
from lipstream.models.config import model_config
from lipstream.models.layout import UNET_DIR, VAE_DIR, WHISPER_DIR

PREPROCESSOR = {"feature_extractor_type": "WhisperFeatureExtractor", "feature_size": N_MELS,
                "sampling_rate": SAMPLE_RATE, "hop_length": HOP_LENGTH, "chunk_length": SEGMENT_SECONDS,
                "n_fft": N_FFT, "n_samples": SEGMENT_SAMPLES, "nb_max_frames": MEL_FRAMES, "padding_side": "right",
                "padding_value": 0.0, "return_attention_mask": False, "processor_class": "WhisperProcessor"}


def _save(sd: dict[str, torch.Tensor], folder: Path, binary_name: str, safetensors_name: str, binary: bool) -> None:
    sd = {k: v.contiguous() for k, v in sd.items()}
    if binary:
        torch.save(sd, folder / binary_name)
    else:
        from safetensors.torch import save_file

        save_file(sd, str(folder / safetensors_name), metadata={"format": "pt"})


def write_random_checkpoint(root: str | Path, *, size: str = "tiny", seed: int = 0, binary: bool = True) -> Path:
    """Seeded random weights saved in the upstream layout under `root`: the same networks as
    `load_musetalk(random_weights=True, size=size, seed=seed)` builds.

    `binary=True` writes the legacy formats upstream ships (unet.pth, diffusion_pytorch_model.bin,
    pytorch_model.bin); `False` writes safetensors where upstream also offers them.
    """
    root = Path(root)
    config = model_config(size)
    for sub in (UNET_DIR, VAE_DIR, WHISPER_DIR):
        (root / sub).mkdir(parents=True, exist_ok=True)

    unet = build.build_unet(config.unet, device="cpu", seed=seed)
    (root / UNET_DIR / "musetalk.json").write_text(json.dumps(config.unet, indent=2))
    _save(unet.state_dict(), root / UNET_DIR, "unet.pth", "unet.safetensors", binary)

    vae = build.build_vae(config.vae, device="cpu", seed=seed + 1)
    (root / VAE_DIR / "config.json").write_text(json.dumps(config.vae, indent=2))
    _save(vae.state_dict(), root / VAE_DIR, "diffusion_pytorch_model.bin", "diffusion_pytorch_model.safetensors",
          binary)

    whisper = build.build_whisper_encoder(config.whisper, device="cpu", seed=seed + 2)
    (root / WHISPER_DIR / "config.json").write_text(json.dumps({"model_type": "whisper", **config.whisper}, indent=2))
    _save({f"model.encoder.{k}": v for k, v in whisper.state_dict().items()}, root / WHISPER_DIR,
          "pytorch_model.bin", "model.safetensors", binary)
    (root / WHISPER_DIR / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2))

    # the face tracker, where upstream's download puts it: an mmengine checkpoint ({"state_dict": ...}) of
    # this size's DWPose (the loader tells the sizes apart by their shapes)
    dwpose = build.build_dwpose(size, device="cpu", seed=seed + 3).state_dict()
    (root / "dwpose").mkdir(exist_ok=True)
    if binary:
        torch.save({"meta": {}, "state_dict": {k: v.contiguous() for k, v in dwpose.items()}},
                   root / "dwpose" / "dw-ll_ucoco_384.pth")
    else:
        _save(dwpose, root / "dwpose", "", "dw-ll_ucoco_384.safetensors", binary)
    return root
