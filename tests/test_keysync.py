"""KeySync's networks against their references, on tiny random configurations (diffusers, the test extra)."""

from __future__ import annotations

import json

import pytest
import torch

from lipstream.models.svd_vae import SVDVAE, SVDVAEConfig


def _same_weights(ours: torch.nn.Module, reference: torch.nn.Module) -> None:
    """The reference's parameters into ours, key for key and strict."""
    ours.load_state_dict(reference.state_dict(), strict=True)


@pytest.mark.parametrize("channels,layers", [((32, 64), 1), ((32, 32, 64), 2)])
def test_the_svd_vae_equals_diffusers_temporal_decoder_vae(channels, layers):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    reference = diffusers.AutoencoderKLTemporalDecoder(block_out_channels=channels, layers_per_block=layers,
                                                       down_block_types=("DownEncoderBlock2D",) * len(channels)).eval()
    with torch.no_grad():  # the blends away from their initial 0.5, so a wrong direction shows
        for name, p in reference.named_parameters():
            if name.endswith("mix_factor"):
                p.fill_(float(torch.randn(())))
    config = SVDVAEConfig.from_dict(json.loads(json.dumps(dict(reference.config))))  # as its config.json reads
    ours = SVDVAE(config).eval()
    _same_weights(ours, reference)
    frames = torch.rand(6, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        want = reference.encode(frames).latent_dist.mean
        got = ours.encode(frames)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        z = torch.randn(6, 4, 8, 8)
        want = reference.decode(z, num_frames=3).sample  # two clips of three frames
        got = ours.decode(z, frames=3)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        one_by_one = torch.cat([ours.decode(z[i:i + 1], frames=1) for i in range(6)])
        assert (one_by_one - got).abs().max() > 1e-3  # the frames of a clip decode together
    with pytest.raises(ValueError, match="latents: 6 frames are not whole clips of 4"):
        ours.decode(z, frames=4)


def test_the_svd_vae_config_refuses_what_it_does_not_implement():
    with pytest.raises(ValueError, match="down_block_types"):
        SVDVAEConfig.from_dict({"down_block_types": ["DownEncoderBlock3D"]})
    with pytest.raises(ValueError, match="unknown key 'mid_block_type'"):
        SVDVAEConfig.from_dict({"mid_block_type": "x"})
