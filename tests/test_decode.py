"""The VAE decode of the mask's rows only: exact geometry, approximate only through GroupNorm."""

from __future__ import annotations

import copy

import pytest
import torch

from lipstream.avatar import load_avatar
from lipstream.engine import ModuleEngine, FrameRequest
from lipstream.errors import InputError
from lipstream.engine.blend import untouched
from lipstream.engine.decode import HALO, first_mask_row
from lipstream.models.blocks import NEAR, GroupNorm
from lipstream.engine.options import EngineOptions

ROW = 12


def test_cropped_decode_is_the_full_decode_below_its_reach_when_groupnorm_is_taken_out(tiny_models):
    """With GroupNorm (the one global statistic) replaced by identity, the crop is exact below the
    zero-padded edge's receptive field, and zero above the crop."""
    decoder = copy.deepcopy(tiny_models.vae.decoder)
    for module in decoder.modules():
        if isinstance(module, GroupNorm):
            module.forward = lambda x, near=False: x
    z = torch.randn(3, 4, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full, crop = decoder(z), decoder(z, row=ROW)
    assert crop.shape == full.shape
    assert torch.count_nonzero(crop[:, :, :8 * ROW]) == 0
    reach = 8 * (ROW + 6)  # 3x3 convs after the crop: 6 latent rows at most in this layout
    torch.testing.assert_close(crop[:, :, reach:], full[:, :, reach:], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(crop[:, :, 8 * ROW:8 * ROW + 8], full[:, :, 8 * ROW:8 * ROW + 8])  # the edge differs


def test_cropped_decode_with_groupnorm_stays_close(tiny_models):
    z = torch.randn(2, 4, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = tiny_models.vae.decoder(z)
        crop = tiny_models.vae.decoder(z, row=ROW)
    below = slice(8 * (ROW + HALO), None)
    err = (crop[:, :, below] - full[:, :, below]).abs().mean() / full[:, :, below].abs().mean()
    assert err < 0.25  # the statistics of the lower rows only: close, not equal
    assert err > 0


def test_engine_decodes_the_mask_rows_and_the_frames_stay_close(tiny_models, presenter):
    avatar = load_avatar(presenter)
    assert first_mask_row(avatar.masks) >= 8 * (ROW + HALO)
    windows = torch.randn(avatar.num_frames, 50, 384, generator=torch.Generator().manual_seed(2))
    out = {}
    for rows in ("full", "mask"):
        engine = ModuleEngine(tiny_models, EngineOptions(batch=4, decode_rows=rows, decode_row=ROW))
        slot = engine.add_avatar(load_avatar(presenter))
        out[rows] = engine.render([FrameRequest(slot, i, windows[i]) for i in range(avatar.num_frames)]).float()
    w, h = avatar.size
    for i in range(avatar.num_frames):
        box = avatar.boxes[i].tolist()
        keep = torch.from_numpy(untouched(h, w, [box]))
        assert torch.equal(out["mask"][i][keep], out["full"][i][keep])  # outside the box: the frame itself
        x1, y1, x2, y2 = box
        d = out["mask"][i][:h][y1:y2, x1:x2] - out["full"][i][:h][y1:y2, x1:x2]
        assert 10 * torch.log10(255 ** 2 / (d ** 2).mean().clamp(min=1e-6)) > 30  # the face: close, not equal
        upper = slice(y1, y1 + (y2 - y1) * 8 * ROW // 256)
        assert torch.equal(out["mask"][i][upper, x1:x2], out["full"][i][upper, x1:x2])  # no mask up there


def test_engine_refuses_an_avatar_whose_mask_starts_above_the_decoded_rows(tiny_models, presenter):
    avatar = load_avatar(presenter)
    avatar.masks = avatar.masks.clone()
    avatar.masks[:, 40:50, 100:150] = 255
    engine = ModuleEngine(tiny_models, EngineOptions(batch=4, decode_rows="mask", decode_row=ROW))
    with pytest.raises(InputError, match="starts at face row 40"):
        engine.add_avatar(avatar)
    with pytest.raises(ValueError, match="decode_rows"):
        ModuleEngine(tiny_models, EngineOptions(batch=4, decode_rows="top"))


def test_auto_decode_crops_the_avatars_that_allow_it_and_decodes_the_others_whole(tiny_models, presenter):
    high = load_avatar(presenter)
    high.masks = high.masks.clone()
    high.masks[:, 40:50, 100:150] = 255  # reaches above the cropped rows
    windows = torch.randn(4, 50, 384, generator=torch.Generator().manual_seed(5))
    out = {}
    for rows in ("full", "mask", "auto"):
        engine = ModuleEngine(tiny_models, EngineOptions(batch=4, decode_rows=rows, decode_row=ROW))
        low = engine.add_avatar(load_avatar(presenter))
        out[rows, "low"] = engine.render([FrameRequest(low, i, windows[i]) for i in range(4)]).clone()
        if rows != "mask":
            slot = engine.add_avatar(copy.copy(high))
            out[rows, "high"] = engine.render([FrameRequest(slot, i, windows[i]) for i in range(4)]).clone()
            both = [FrameRequest(slot if i % 2 else low, i, windows[i]) for i in range(4)]
            out[rows, "both"] = engine.render(both).clone()
    assert not torch.equal(out["mask", "low"], out["full", "low"])
    assert torch.equal(out["auto", "low"], out["mask", "low"])  # every avatar of the batch fits: cropped
    assert torch.equal(out["auto", "high"], out["full", "high"])  # this one does not: whole
    assert torch.equal(out["auto", "both"], out["full", "both"])  # a batch with both: whole


def test_cut_groupnorm_is_groupnorm_of_the_map_with_its_cut_rows_like_their_neighbours():
    norm = GroupNorm(4, 8)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    x = torch.randn(2, 8, 10, 10, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(norm(x, near=True), norm(x))  # nothing cut: a plain GroupNorm
    h = 8  # 2 rows cut; "near" takes them to look like the first 8 // NEAR = 2 decoded rows
    assert h // NEAR == 10 - h
    decoded = x[:, :, 2:]
    stand_in = torch.cat([decoded[:, :, :2], decoded], dim=2)
    torch.testing.assert_close(norm(decoded, near=True), norm(stand_in)[:, :, 2:], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(norm(decoded, near=True), norm(decoded))


def test_near_statistics_differ_from_the_rows_alone_and_change_nothing_uncut(tiny_models):
    decoder = tiny_models.vae.decoder
    z = torch.randn(2, 4, 32, 32, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        a, b = decoder(z, row=ROW, near=True), decoder(z, row=ROW)
        assert torch.equal(decoder(z, near=True), decoder(z))  # square maps: near changes nothing
    assert a.shape == b.shape and not torch.allclose(a, b)
    with pytest.raises(ValueError, match="decode_stats"):
        ModuleEngine(tiny_models, EngineOptions(batch=4, decode_stats="mean"))


def test_graph_bookkeeping_of_auto_decode_matches_the_eager_path(tiny_models, presenter, replay_graphs):
    """The graph path (static buffers keyed by bucket and decode kind) gives the eager path's frames."""
    high = load_avatar(presenter)
    high.masks = high.masks.clone()
    high.masks[:, 40:50, 100:150] = 255
    windows = torch.randn(7, 50, 384, generator=torch.Generator().manual_seed(6))
    out = {}
    for graphs in (False, True):
        engine = ModuleEngine(tiny_models, EngineOptions(batch=4, graphs=graphs, decode_rows="auto", decode_row=ROW), buckets=(2, 4))
        low, slot = engine.add_avatar(load_avatar(presenter)), engine.add_avatar(copy.copy(high))
        engine.warm_up()
        for name, requests in {"low": [FrameRequest(low, i % 6, windows[i]) for i in range(7)],
                               "high": [FrameRequest(slot, i % 6, windows[i]) for i in range(3)],
                               "both": [FrameRequest((low, slot)[i % 2], i % 6, windows[i]) for i in range(5)]}.items():
            out[graphs, name] = engine.render(requests).clone()
        if graphs:
            assert {key[1] for key in engine._net} == {True, False}  # both decode kinds captured
    for name in ("low", "high", "both"):
        torch.testing.assert_close(out[True, name], out[False, name], rtol=0, atol=1)


def test_the_reference_path_stays_exact_whatever_the_fast_defaults(tiny_models):
    """The fast engine's defaults crop the decode and fuse the upsamplers; the reference does neither."""
    from lipstream.engine import ReferenceEngine

    latents = torch.randn(2, 8, 32, 32, generator=torch.Generator().manual_seed(7))
    windows = torch.randn(2, 50, 384, generator=torch.Generator().manual_seed(8))
    fast, reference = ModuleEngine(tiny_models, EngineOptions(batch=4)), ReferenceEngine(tiny_models)
    plain = ModuleEngine(tiny_models, EngineOptions(batch=4, decode_rows="full", upsample="plain"))
    with torch.inference_mode():
        want = plain.faces(latents, windows)
        assert torch.equal(reference.faces(latents, windows), want)
        assert not torch.allclose(fast.faces(latents, windows), want, atol=1e-3)  # cropped: close, not equal
