"""Nearest 2x upsample + 3x3 conv folded into one convolution: the same numbers, fewer FLOPs."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.upsampling import Upsample2D
from torch.utils.flop_counter import FlopCounterMode

from lipstream.avatar import load_avatar
from lipstream.engine import Engine, FrameRequest
from lipstream.engine.upsample import FUSED_MODES, FusedUpsample, fuse_upsamplers
from lipstream.options import UPSAMPLE_MODES, EngineOptions

FUSED = FUSED_MODES


@pytest.mark.parametrize("mode", FUSED)
@pytest.mark.parametrize("size", [(7, 9), (1, 1), (8, 8)])
def test_fused_upsample_is_the_plain_one(mode, size):
    torch.manual_seed(0)
    plain = Upsample2D(6, use_conv=True, out_channels=5).double()
    x = torch.randn(3, 6, *size, dtype=torch.double)
    fused = FusedUpsample(plain, mode)
    torch.testing.assert_close(fused(x), plain(x), rtol=0, atol=1e-12)
    odd = (2 * size[0] + 1, 2 * size[1] + 1)  # a UNet skip connection of odd size: the plain path
    torch.testing.assert_close(fused(x, odd), plain(x, odd), rtol=0, atol=0)


def test_only_nearest_upsample_with_a_3x3_conv_is_fused():
    with pytest.raises(ValueError, match="3x3"):
        FusedUpsample(Upsample2D(4, use_conv=True, kernel_size=5, padding=2), "phases")
    with pytest.raises(ValueError, match="3x3"):
        FusedUpsample(Upsample2D(4, use_conv_transpose=True), "phases")
    with pytest.raises(ValueError, match="mode"):
        FusedUpsample(Upsample2D(4, use_conv=True), "plain")


@pytest.mark.parametrize("mode", FUSED)
def test_fused_decoder_matches_shares_weights_and_leaves_the_original_alone(tiny_models, mode):
    decoder = tiny_models.vae.decoder
    fused = fuse_upsamplers(decoder, mode)
    kinds = lambda m: [type(x).__name__ for x in m.modules()]  # noqa: E731
    assert "FusedUpsample" not in kinds(decoder) and "Upsample2D" in kinds(decoder)
    assert kinds(fused).count("FusedUpsample") == kinds(decoder).count("Upsample2D") > 0
    assert fused.conv_in.weight is decoder.conv_in.weight  # shared, not copied
    z = torch.randn(2, decoder.conv_in.in_channels, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(fused(z), decoder(z), rtol=1e-4, atol=1e-4)
        counts = []
        for module in (decoder, fused):
            counter = FlopCounterMode(display=False)
            with counter:
                module(z)
            counts.append(counter.get_total_flops())
    assert counts[1] < counts[0]


def test_engine_with_fused_upsamplers_renders_the_same_frames(tiny_models, presenter):
    avatar = load_avatar(presenter)
    windows = torch.randn(6, 50, 384, generator=torch.Generator().manual_seed(3))
    out = {}
    for mode in UPSAMPLE_MODES:
        engine = Engine(tiny_models, EngineOptions(batch=4, upsample=mode))
        slot = engine.add_avatar(load_avatar(presenter))
        out[mode] = engine.render([FrameRequest(slot, i % avatar.num_frames, windows[i]) for i in range(6)]).int()
    for mode in FUSED:
        assert (out[mode] - out["plain"]).abs().max() <= 1  # uint8 rounding of the same numbers
    assert all(type(m).__name__ != "FusedUpsample" for m in tiny_models.unet.modules())
    with pytest.raises(ValueError, match="upsample"):
        Engine(tiny_models, EngineOptions(batch=4, upsample="bilinear"))


def test_engines_on_the_same_networks_share_one_fused_copy(tiny_models):
    """So torch.compile's per-module cache serves every engine (no second trace and compile)."""
    a, b = (Engine(tiny_models, EngineOptions(batch=4, upsample="phases", decode_rows="auto")) for _ in range(2))
    for cropped in (False, True):
        assert a._steps[cropped].unet is b._steps[cropped].unet
        assert a._steps[cropped].decoder is b._steps[cropped].decoder
    assert Engine(tiny_models, EngineOptions(batch=4, upsample="transpose"))._steps[False].unet is not a._steps[False].unet
