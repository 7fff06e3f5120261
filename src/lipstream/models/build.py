"""Construct the three networks from their configs: empty (meta) for loading, or seeded random."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from lipstream.models.unet import UNet, UNetConfig
from lipstream.models.vae import VAE, VAEConfig
from lipstream.models.whisper import WhisperConfig, WhisperEncoder, init_random_


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


def build_unet(cfg: dict[str, Any], *, device: torch.device | str = "meta", seed: int | None = None) -> UNet:
    config = UNetConfig.from_dict(cfg)
    with _on(device, seed):
        return UNet(config).eval().requires_grad_(False)


def build_vae(cfg: dict[str, Any], *, device: torch.device | str = "meta", seed: int | None = None) -> VAE:
    config = VAEConfig.from_dict(cfg)
    with _on(device, seed):
        return VAE(config).eval().requires_grad_(False)


def build_whisper_encoder(cfg: dict[str, Any], *, device: torch.device | str = "meta",
                          seed: int | None = None) -> WhisperEncoder:
    config = WhisperConfig.from_dict(cfg)
    with _on(device, seed):
        encoder = WhisperEncoder(config).eval().requires_grad_(False)
        return encoder if seed is None or torch.device(device).type == "meta" else init_random_(encoder)
