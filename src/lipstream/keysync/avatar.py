"""What KeySync needs of an avatar: the square around its face, each loop frame's latents in that square and
the reference's mask of the generated region. Made at render time, or once at compile (`compile --keysync`,
`keysync.safetensors` in the avatar's folder, read back when the VAE and the square still match)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from lipstream.avatar.colour import i420_to_rgb
from lipstream.keysync.schedule import box_masks
from lipstream.models.checkpoint import fingerprint

CROP_SCALE = 2.0  # the square's side over the face landmarks' size
PREPARED = "keysync.safetensors"
SCALE = 0.18215


def crop_square(landmarks: np.ndarray, width: int, height: int) -> tuple[int, int, int, int]:
    """The square (x1, y1, x2, y2) KeySync sees of an avatar: around the landmarks' box over the loop (frames
    without a face left out), CROP_SCALE times the face's size plus how far it moves, even-sided and inside
    the frame. LipStream's choice: KeySync's own scripts take videos already cropped to the face."""
    seen = landmarks[~np.isnan(landmarks).any(axis=(1, 2))]
    if len(seen) == 0:
        side = min(width, height) // 2 * 2
        return (width - side) // 2, (height - side) // 2, (width + side) // 2, (height + side) // 2
    low, high = seen.min(axis=1), seen.max(axis=1)  # [N, 2] per frame
    centre = np.median((low + high) / 2, axis=0)
    face = np.median((high - low).max(axis=1))  # the face's size in one frame
    travel = (high.max(axis=0) - low.min(axis=0)).max() - face  # how far it moves over the loop
    side = int(min(CROP_SCALE * face + travel, width, height)) // 2 * 2
    x1 = int(np.clip(round(centre[0] - side / 2), 0, width - side))
    y1 = int(np.clip(round(centre[1] - side / 2), 0, height - side))
    return x1, y1, x1 + side, y1 + side


def encoder_fingerprint(vae: torch.nn.Module) -> str:
    """Which encoder made a set of latents (the decoder does not matter to them)."""
    return fingerprint({k: v for k, v in vae.state_dict().items() if not k.startswith("decoder.")})


def crops(avatar, square: tuple[int, int, int, int], frames: list[int], size: int,
          device: torch.device) -> torch.Tensor:
    """[n, 3, size, size] float RGB in [0, 1]: these loop frames' squares."""
    w, h = avatar.size
    x1, y1, x2, y2 = square
    rgb = i420_to_rgb(avatar.frames[frames].to(device), h, w, avatar.meta["colour_matrix"])[:, y1:y2, x1:x2]
    cut = rgb.permute(0, 3, 1, 2).float() / 255.0
    return F.interpolate(cut, size=(size, size), mode="bilinear", align_corners=False, antialias=True)


def masks(avatar, square: tuple[int, int, int, int], frames: list[int], size: int) -> np.ndarray:
    """[n, size/8, size/8] the generated region of these loop frames (none where the tracker found no face)."""
    x1, y1, x2, _ = square
    points = avatar.landmarks[frames].float().cpu().numpy()
    scaled = (points - np.array([x1, y1])) * (size / (x2 - x1))
    faceless = np.isnan(scaled).any(axis=(1, 2))
    out = box_masks(np.nan_to_num(scaled), size, size // 8)
    out[faceless] = 0.0
    return out


def latents(avatar, square, frames: list[int], vae, size: int, device: torch.device, batch: int = 16) -> torch.Tensor:
    """[n, 4, size/8, size/8] scaled latents of these loop frames' squares (the posterior mean)."""
    with torch.inference_mode():
        return torch.cat([vae.encode(crops(avatar, square, frames[i:i + batch], size, device) * 2.0 - 1.0) * SCALE
                          for i in range(0, len(frames), batch)])


def prepare_avatar(avatar, vae, size: int, device: torch.device) -> Path:
    """Write the avatar's `keysync.safetensors` (every loop frame's latents and mask in its square), whole or
    not at all."""
    from safetensors.torch import save_file

    avatar.wait_frames()
    square = crop_square(avatar.landmarks.float().cpu().numpy(), *avatar.size)
    frames = list(range(avatar.num_frames))
    tensors = {"latents": latents(avatar, square, frames, vae, size, device).float().cpu().contiguous(),
               "masks": torch.from_numpy(masks(avatar, square, frames, size)).contiguous()}
    meta = {"square": ",".join(map(str, square)), "size": str(size), "encoder": encoder_fingerprint(vae)}
    path = Path(avatar.path) / PREPARED
    tmp = path.with_name(f".{PREPARED}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_prepared(avatar, vae, size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The avatar's prepared latents and masks, where they were made by this encoder at this size in the square
    this avatar has; else None (made again at render)."""
    from safetensors import safe_open

    path = Path(avatar.path) / PREPARED
    if not path.is_file():
        return None
    square = crop_square(avatar.landmarks.float().cpu().numpy(), *avatar.size)
    try:
        with safe_open(str(path), "pt", device="cpu") as f:
            meta = f.metadata() or {}
            if (meta.get("square") != ",".join(map(str, square)) or meta.get("size") != str(size)
                    or meta.get("encoder") != encoder_fingerprint(vae)):
                return None
            found = f.get_tensor("latents"), f.get_tensor("masks")
    except Exception:  # noqa: BLE001  (a damaged file is made again, not trusted)
        return None
    if found[0].shape[0] != avatar.num_frames or found[1].shape[0] != avatar.num_frames:
        return None
    return found[0].to(device), found[1].to(device)
