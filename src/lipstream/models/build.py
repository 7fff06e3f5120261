"""Construct the three networks from configs: empty (meta) for loading, or seeded random."""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from diffusers import AutoencoderKL, UNet2DConditionModel
from transformers import WhisperConfig
from transformers.models.whisper.modeling_whisper import WhisperEncoder

for _name in ("diffusers", "transformers"):  # their per-model info chatter is noise for a CLI
    logging.getLogger(_name).setLevel(logging.ERROR)


def _public(cfg: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def whisper_config(cfg: dict[str, Any]) -> WhisperConfig:
    config = WhisperConfig(**_public(cfg))
    config._attn_implementation = "sdpa"
    return config


@contextlib.contextmanager
def _on(device: torch.device | str, seed: int | None):
    """Construct on `device` ("meta": no memory, no init) with a forked, seeded RNG.

    Random weights are drawn on the device that will run them (a full-size UNet takes ~12 s to
    initialise on a 2-core CPU, a fraction of a second on a GPU), so the same seed gives the same
    weights on the same kind of device.
    """
    device = torch.device(device)
    if seed is None or device.type == "meta":
        with device:
            yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), device:
        torch.manual_seed(seed)
        yield


def build_unet(cfg: dict[str, Any], *, device: torch.device | str = "meta", seed: int | None = None) -> UNet2DConditionModel:
    with _on(device, seed):
        return UNet2DConditionModel.from_config(_public(cfg)).eval().requires_grad_(False)


def build_vae(cfg: dict[str, Any], *, device: torch.device | str = "meta", seed: int | None = None) -> AutoencoderKL:
    with _on(device, seed):
        return AutoencoderKL.from_config(_public(cfg)).eval().requires_grad_(False)


def build_whisper_encoder(cfg: dict[str, Any], *, device: torch.device | str = "meta", seed: int | None = None) -> WhisperEncoder:
    with _on(device, seed):
        return WhisperEncoder(whisper_config(cfg)).eval().requires_grad_(False)
