"""Avatars kept loaded across renders, as a service keeps its presenters.

Decoding a 1080p loop's frames takes a quarter of a second of every core, just when the first
frames are being rendered and encoded; a process that renders the same presenter again (a server,
the benchmark, a batch of scripts) need not pay it twice. Entries are keyed by the files' change
times, so a recompiled avatar is loaded afresh, and the least recently used ones are dropped past
a memory budget ($LIPSTREAM_RESIDENT_GIB, default 8; 0 turns the cache off).
"""

from __future__ import annotations

import copy
import os
from collections import OrderedDict
from pathlib import Path

import torch

from lipstream.avatar.cache import FRAMES, META, TENSORS, Avatar, load_avatar

_RESIDENT: OrderedDict[tuple, Avatar] = OrderedDict()


def budget_bytes() -> int:
    return int(float(os.environ.get("LIPSTREAM_RESIDENT_GIB", "8")) * 2**30)


def _key(folder: Path, device: torch.device, vae_fingerprint: str | None) -> tuple:
    stamps = tuple(os.stat(folder / name).st_mtime_ns if (folder / name).exists() else None
                   for name in (META, TENSORS, FRAMES))
    return str(folder.resolve()), str(device), vae_fingerprint, stamps


def _bytes(avatar: Avatar) -> int:
    tensors = (avatar.frames, avatar.latents, avatar.masks, avatar.boxes, avatar.landmarks)
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def resident_avatar(folder: str | Path, device: str | torch.device = "cpu", *,
                    vae_fingerprint: str | None = None) -> Avatar:
    """`load_avatar(folder, device, background=True)`, or the copy already loaded in this process.

    Returns a shallow copy: a caller may replace its tensors (an engine casts the latents) without
    touching the resident one.
    """
    folder, device = Path(folder), torch.device(device)
    if budget_bytes() <= 0:
        return load_avatar(folder, device, background=True, vae_fingerprint=vae_fingerprint)
    key = _key(folder, device, vae_fingerprint) if (folder / META).is_file() else None
    avatar = _RESIDENT.pop(key, None) if key else None
    if avatar is None or (avatar.loader is not None and avatar.loader.error is not None):
        avatar = load_avatar(folder, device, background=True, vae_fingerprint=vae_fingerprint)
    _RESIDENT[key] = avatar
    while len(_RESIDENT) > 1 and sum(map(_bytes, _RESIDENT.values())) > budget_bytes():
        _RESIDENT.popitem(last=False)  # the least recently used
    return copy.copy(avatar)


def drop_resident() -> None:
    """Forget every resident avatar (their memory goes when no engine holds them)."""
    _RESIDENT.clear()
