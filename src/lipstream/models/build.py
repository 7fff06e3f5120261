"""Construct the networks from their configs: empty (meta) for loading, or seeded random."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from lipstream.models.dwpose import DWPose, DWPoseConfig, dwpose_config
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


def build_dwpose(size: str | DWPoseConfig = "full", *, device: torch.device | str = "meta",
                 seed: int | None = None) -> DWPose:
    """The network in eval mode: empty on "meta" (for loading), else with weights drawn from `seed`.

    Beyond torch's own initialisation, BatchNorm gains and variances and the head's scales are drawn from
    [0.5, 1.5], shifts, means and the GAU's q/k offsets from N(0, 0.1): no tensor keeps a constant value
    that a loading or equality test could miss. They are not a pose model.
    """
    config = dwpose_config(size) if isinstance(size, str) else size
    with _on(device, seed):
        net = DWPose(config).eval().requires_grad_(False)
        if seed is not None and torch.device(device).type != "meta":
            for name, t in net.state_dict().items():
                if name.endswith(("bn.weight", "running_var", ".g", "res_scale.scale")):
                    t.uniform_(0.5, 1.5)
                elif name.endswith(("bn.bias", "running_mean", "gamma", "beta")):
                    t.normal_(0.0, 0.1)
    return net
