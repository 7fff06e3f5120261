"""Nearest 2x upsample + 3x3 conv folded into one convolution: the same numbers, fewer FLOPs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lipstream.avatar import load_avatar
from lipstream.engine import ModuleEngine, FrameRequest
from lipstream.models.blocks import Upsample, fuse_upsamplers
from lipstream.engine.options import UPSAMPLE_MODES, EngineOptions

FUSED = tuple(m for m in UPSAMPLE_MODES if m != "plain")


@pytest.mark.parametrize("mode", FUSED)
@pytest.mark.parametrize("size", [(7, 9), (1, 1), (8, 8)])
def test_fused_upsample_is_the_plain_one(mode, size):
    torch.manual_seed(0)
    up = Upsample(6).double()
    up.fuse(mode)
    x = torch.randn(3, 6, *size, dtype=torch.double)
    torch.testing.assert_close(up(x, mode), up(x), rtol=0, atol=1e-12)
    odd = (2 * size[0] + 1, 2 * size[1] + 1)  # a UNet skip connection of odd size: the plain path
    torch.testing.assert_close(up(x, mode, odd), up(x, "plain", odd), rtol=0, atol=0)


def test_plain_upsample_is_diffusers_upsample2d():
    from diffusers.models.upsampling import Upsample2D

    torch.manual_seed(1)
    up = Upsample(5).double()
    reference = Upsample2D(5, use_conv=True).double()
    reference.load_state_dict(up.state_dict())
    x = torch.randn(2, 5, 6, 7, dtype=torch.double)
    torch.testing.assert_close(up(x), reference(x), rtol=0, atol=0)
    torch.testing.assert_close(up(x, size=(13, 15)), reference(x, output_size=(13, 15)), rtol=0, atol=0)


def test_a_mode_must_be_prepared_and_known():
    up = Upsample(4)
    with pytest.raises(RuntimeError, match="fuse"):
        up(torch.randn(1, 4, 2, 2), "phases")
    with pytest.raises(ValueError, match="upsample mode"):
        up.fuse("bilinear")
    up.fuse("phases")
    assert "folded_phases" not in up.state_dict()  # derived, never in a checkpoint


@pytest.mark.parametrize("mode", FUSED)
def test_fused_decoder_matches_and_does_fewer_flops(tiny_models, mode):
    decoder = tiny_models.vae.decoder
    fuse_upsamplers(decoder, mode)
    z = torch.randn(2, decoder.conv_in.in_channels, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(decoder(z, mode), decoder(z), rtol=1e-4, atol=1e-4)
        counts = []
        for m in ("plain", mode):
            counter = FlopCounterMode(display=False)
            with counter:
                decoder(z, m)
            counts.append(counter.get_total_flops())
    assert counts[1] < counts[0]


@pytest.mark.slow
def test_engine_with_fused_upsamplers_renders_the_same_frames(tiny_models, presenter):
    avatar = load_avatar(presenter)
    windows = torch.randn(6, 50, 384, generator=torch.Generator().manual_seed(3))
    out = {}
    for mode in UPSAMPLE_MODES:
        engine = ModuleEngine(tiny_models, EngineOptions(batch=4, upsample=mode))
        slot = engine.add_avatar(load_avatar(presenter))
        out[mode] = engine.render([FrameRequest(slot, i % avatar.num_frames, windows[i]) for i in range(6)]).int()
    for mode in FUSED:
        assert (out[mode] - out["plain"]).abs().max() <= 1  # uint8 rounding of the same numbers
    with pytest.raises(ValueError, match="upsample"):
        ModuleEngine(tiny_models, EngineOptions(batch=4, upsample="bilinear"))


def test_engines_on_the_same_networks_share_the_modules_and_one_fold(tiny_models):
    """So torch.compile's per-module cache serves every engine (no second trace and compile)."""
    a, b = (ModuleEngine(tiny_models, EngineOptions(batch=4, upsample="phases", decode_rows="auto")) for _ in range(2))
    for cropped in (False, True):
        assert a._steps[cropped].unet is b._steps[cropped].unet is tiny_models.unet
        assert a._steps[cropped].decoder is b._steps[cropped].decoder is tiny_models.vae.decoder
    up = next(m for m in tiny_models.vae.decoder.modules() if isinstance(m, Upsample))
    folded = up.folded_phases
    ModuleEngine(tiny_models, EngineOptions(batch=4, upsample="phases"))
    assert up.folded_phases is folded  # folded once per mode
