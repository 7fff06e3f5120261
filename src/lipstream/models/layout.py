"""Where the model files live: the upstream MuseTalk download layout, and how to find the folder."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "LIPSTREAM_MODELS"
DEFAULT_DIR = Path("~/.cache/lipstream/models")

UNET_DIR = "musetalkV15"
VAE_DIR = "sd-vae"
WHISPER_DIR = "whisper"


@dataclass(frozen=True)
class UpstreamFile:
    """A file of the layout and the Hugging Face repository it comes from."""

    path: str  # relative to the models folder
    repo: str  # Hugging Face repo id
    repo_path: str  # path inside that repo
    alternatives: tuple[str, ...] = ()  # other accepted names (relative), first found wins


# What `lipstream weights download` fetches; the loader accepts each file or one of its alternatives.
UPSTREAM_FILES: tuple[UpstreamFile, ...] = (
    UpstreamFile(f"{UNET_DIR}/musetalk.json", "TMElyralab/MuseTalk", "musetalkV15/musetalk.json"),
    UpstreamFile(f"{UNET_DIR}/unet.pth", "TMElyralab/MuseTalk", "musetalkV15/unet.pth",
                 alternatives=(f"{UNET_DIR}/unet.safetensors",)),
    UpstreamFile(f"{VAE_DIR}/config.json", "stabilityai/sd-vae-ft-mse", "config.json"),
    UpstreamFile(f"{VAE_DIR}/diffusion_pytorch_model.safetensors", "stabilityai/sd-vae-ft-mse",
                 "diffusion_pytorch_model.safetensors", alternatives=(f"{VAE_DIR}/diffusion_pytorch_model.bin",)),
    UpstreamFile(f"{WHISPER_DIR}/config.json", "openai/whisper-tiny", "config.json"),
    UpstreamFile(f"{WHISPER_DIR}/preprocessor_config.json", "openai/whisper-tiny", "preprocessor_config.json"),
    UpstreamFile(f"{WHISPER_DIR}/model.safetensors", "openai/whisper-tiny", "model.safetensors",
                 alternatives=(f"{WHISPER_DIR}/pytorch_model.bin",)),
)

# The face tracker compile uses: DWPose (RTMPose-l whole-body), where upstream's download script puts it.
DWPOSE_FILE = UpstreamFile("dwpose/dw-ll_ucoco_384.pth", "yzd-v/DWPose", "dw-ll_ucoco_384.pth",
                           alternatives=("dwpose/dw-ll_ucoco_384.safetensors",))
TRACKER_FILES: tuple[UpstreamFile, ...] = (DWPOSE_FILE,)

# KeySync (`--model keysync`): its two checkpoints and WavLM from its own repository (under checkpoints/, where
# its README's `git clone` puts them), HuBERT from facebook, the SVD VAE as its pipeline loads it (the fp16
# variant; a gated repository: accept its licence on the hub and log in first). Each local path ends with
# the repository's path, as `weights download` places files.
KEYSYNC_DIR = "keysync"
_SVD = f"{KEYSYNC_DIR}/stable-video-diffusion-img2vid"
_HUBERT = f"{KEYSYNC_DIR}/hubert-base-ls960"
KEYSYNC_FILES: tuple[UpstreamFile, ...] = (
    UpstreamFile(f"{KEYSYNC_DIR}/checkpoints/keyframe_dub.pt", "toninio19/keysync", "checkpoints/keyframe_dub.pt"),
    UpstreamFile(f"{KEYSYNC_DIR}/checkpoints/interpolation_dub.pt", "toninio19/keysync",
                 "checkpoints/interpolation_dub.pt"),
    UpstreamFile(f"{KEYSYNC_DIR}/checkpoints/WavLM-Base+.pt", "toninio19/keysync", "checkpoints/WavLM-Base+.pt"),
    UpstreamFile(f"{_HUBERT}/config.json", "facebook/hubert-base-ls960", "config.json"),
    UpstreamFile(f"{_HUBERT}/model.safetensors", "facebook/hubert-base-ls960", "model.safetensors",
                 alternatives=(f"{_HUBERT}/pytorch_model.bin",)),
    UpstreamFile(f"{_SVD}/vae/config.json", "stabilityai/stable-video-diffusion-img2vid", "vae/config.json"),
    UpstreamFile(f"{_SVD}/vae/diffusion_pytorch_model.fp16.safetensors", "stabilityai/stable-video-diffusion-img2vid",
                 "vae/diffusion_pytorch_model.fp16.safetensors",
                 alternatives=(f"{_SVD}/vae/diffusion_pytorch_model.safetensors",)),
)

HOW_TO_GET = "run `lipstream weights download` (needs internet), or pass --models DIR / set LIPSTREAM_MODELS"


def models_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The models folder: `--models`, else $LIPSTREAM_MODELS, else ~/.cache/lipstream/models."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    return DEFAULT_DIR.expanduser()


def upstream_file(rel_path: str) -> UpstreamFile:
    for f in (*UPSTREAM_FILES, *TRACKER_FILES, *KEYSYNC_FILES):
        if f.path == rel_path:
            return f
    raise KeyError(rel_path)


def find(root: Path, rel_path: str) -> Path | None:
    """The first existing file among `rel_path` and its alternatives, or None."""
    entry = upstream_file(rel_path)
    for candidate in (entry.path, *entry.alternatives):
        p = root / candidate
        if p.is_file():
            return p
    return None
