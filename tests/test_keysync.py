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


# --- the UNet and the sampler against KeySync's own code: stored outputs always, the checkout where named

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from safetensors.torch import load_file  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import keysync_reference as ref  # noqa: E402

from lipstream.keysync.sampler import Conditions, sample, sigmas  # noqa: E402
from lipstream.models.keysync import TINY, KeySyncNet  # noqa: E402

GOLDEN = Path(__file__).parent / "data" / "keysync_reference.safetensors"
KINDS = (("keyframe", 8), ("interpolation", 9))


def _ours(kind: str, channels: int, scale: float) -> tuple[KeySyncNet, dict]:
    config = type(TINY)(**{**TINY.to_dict(), "in_channels": channels})
    inp = ref.inputs(kind)
    net = KeySyncNet(config, features=inp["speech"].shape[-1], latent_size=inp["x"].shape[-1]).eval()
    net.load_state_dict(ref.seeded(net.state_dict(), scale=scale), strict=True)
    return net, inp


def _sampled(net: KeySyncNet, inp: dict) -> torch.Tensor:
    cond = Conditions(inp["speech"], inp["latents"], inp["mask"], inp["reference"])
    with torch.no_grad():
        return sample(net, cond, inp["noise"])


@pytest.mark.parametrize("kind,channels", KINDS)
def test_the_keysync_unet_equals_the_reference_outputs(kind, channels):
    net, inp = _ours(kind, channels, 0.2)
    with torch.no_grad():
        got = net.unet(inp["x"], inp["c_noise"], inp["audio"])
    want = load_file(GOLDEN)[f"unet_{kind}"]
    assert want.abs().max() > 1.0  # not a map of zeros
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,channels", KINDS)
def test_a_keysync_sampling_run_equals_the_reference_outputs(kind, channels):
    net, inp = _ours(kind, channels, 0.05)
    got = _sampled(net, inp)
    want = load_file(GOLDEN)[f"sample_{kind}"]
    outside = (1 - inp["mask"]).bool().expand_as(got)
    # the frames' own latents outside the mouth (the last Euler step lands on the denoised latents, rounded)
    torch.testing.assert_close(got[outside], inp["latents"][outside], rtol=0, atol=1e-5)
    assert (got - inp["latents"])[~outside].abs().mean() > 0.1  # and new ones inside
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(ref.checkout() is None, reason=f"no KeySync checkout: set {ref.ENV_VAR}")
@pytest.mark.parametrize("kind,channels", KINDS)
def test_the_keysync_unet_and_sampler_equal_the_checkouts_code(kind, channels):
    """The stored outputs are still what the reference computes (rerun keysync_golden.py when this fails)."""
    net, inp = _ours(kind, channels, 0.2)
    network = ref.unet(net.unet.config)
    network.load_state_dict(net.unet.state_dict(), strict=True)  # key for key: the checkpoint's names
    with torch.no_grad():
        want = ref.run_unet(network, inp["x"], inp["c_noise"], inp["audio"])
        torch.testing.assert_close(net.unet(inp["x"], inp["c_noise"], inp["audio"]), want, rtol=1e-4, atol=1e-4)
    net, inp = _ours(kind, channels, 0.05)
    want = ref.sample(net.unet.config, net.state_dict(), inp["speech"], inp["latents"], inp["mask"],
                      inp["reference"], inp["noise"])
    torch.testing.assert_close(_sampled(net, inp), want, rtol=1e-4, atol=1e-4)


def test_the_noise_table_is_the_reference_one():
    levels = sigmas(10)
    assert levels.dtype == torch.float64 and len(levels) == 12  # 11 Euler steps
    assert levels[0] == 700.0 and levels[-2] == 0.002 and levels[-1] == 0.0
    assert torch.all(levels[:-1] > levels[1:])
    more = sigmas(20)
    assert len(more) == 21 and more[0] == pytest.approx(700.0) and more[-2] == pytest.approx(0.002)
    fewer = sigmas(6)  # the table's every other level
    torch.testing.assert_close(fewer, torch.tensor([700.0, 15.886, 4.248, 0.981, 0.173, 0.002, 0.0],
                                                   dtype=torch.float64))
    with pytest.raises(ValueError, match="steps: 3"):
        sigmas(3)


def test_unguided_steps_run_one_pass_with_every_condition():
    """Below `guidance_until` a step is the UNet's pass with speech and reference alone: the same as guiding
    with both scales at 1 (e_uc + (e_ref - e_uc) + (e_full - e_ref) = e_full), at a third of the batch."""
    net, inp = _ours("interpolation", 9, 0.05)
    cond = Conditions(inp["speech"], inp["latents"], inp["mask"], inp["reference"])
    batches = []
    hook = net.unet.register_forward_pre_hook(lambda m, args: batches.append(args[0].shape[0]))
    with torch.no_grad():
        want = sample(net, cond, inp["noise"], steps=6, audio_scale=1.0, reference_scale=1.0)
        del batches[:]
        got = sample(net, cond, inp["noise"], steps=6, audio_scale=1.0, reference_scale=1.0, guidance_until=701.0)
        n = inp["noise"].shape[0]
        assert batches == [n] * 6  # six steps of one pass
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        del batches[:]
        guided = sample(net, cond, inp["noise"], steps=6, guidance_until=0.5)
    hook.remove()
    assert batches == [3 * n] * 4 + [n] * 2  # 700 .. 0.98 guided, 0.17 and 0.002 not: 14 passes against 18
    assert (guided - _sampled(net, inp)).abs().max() > 1e-3  # not the reference's sampling


# --- the speech encoders

def _randomised(module: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return module


def test_hubert_equals_transformers_hubert_key_for_key():
    transformers = pytest.importorskip("transformers")
    from lipstream.models.hubert import HuBERT, HuBERTConfig

    torch.manual_seed(0)
    config = transformers.HubertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
                                       conv_dim=(32,) * 7, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)
    reference = _randomised(transformers.HubertModel(config).eval())
    ours = HuBERT(HuBERTConfig.from_dict(json.loads(reference.config.to_json_string(use_diff=True)))).eval()
    # transformers now keeps the weight-normalised convolution as a parametrisation; its files, as the model's
    # published ones, store weight_g and weight_v
    renamed = {k.replace("parametrizations.weight.original0", "weight_g")
               .replace("parametrizations.weight.original1", "weight_v"): v for k, v in reference.state_dict().items()}
    ours.load_state_dict(renamed, strict=True)
    wave = torch.randn(2, 16000 + 640 * 3)
    with torch.no_grad():
        want = reference(wave).last_hidden_state
        got = ours(wave)
    assert got.shape == (2, (wave.shape[1] - 400) // 320 + 1, 64)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="feat_extract_norm 'layer' is not supported"):
        HuBERTConfig.from_dict({"feat_extract_norm": "layer"})


def _wavlm():
    from lipstream.models.wavlm import WavLM, WavLMConfig

    ours = WavLM(WavLMConfig.from_dict(ref.WAVLM_CONFIG)).eval()
    ours.load_state_dict(ref.wavlm_state(ours.state_dict()), strict=True)
    return ours


def test_wavlm_equals_the_reference_outputs_and_the_checkouts_code():
    ours = _wavlm()
    speech = ref.wavlm_speech()  # 3 s: 149 tokens, distances past the exact buckets (80) and their log range
    with torch.no_grad():
        got = ours(speech[None])
    want = load_file(GOLDEN)["wavlm"]
    assert got.shape == want.shape == (1, 149, 64)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if ref.checkout() is not None:
        with torch.no_grad():
            torch.testing.assert_close(got, ref.wavlm(ours.state_dict()).extract_features(speech[None])[0],
                                       rtol=1e-4, atol=1e-4)


def test_wavlm_config_reads_the_checkpoint_cfg_and_refuses_other_kinds():
    from lipstream.models.wavlm import WavLMConfig

    c = WavLMConfig.from_dict({**ref.WAVLM_CONFIG, "mask_prob": 0.65, "encoder_layerdrop": 0.05})
    assert c.conv_layers == [(32, 10, 5)] + [(32, 3, 2)] * 4 + [(32, 2, 2)] * 2
    with pytest.raises(ValueError, match="extractor_mode 'layer_norm' is not supported"):
        WavLMConfig.from_dict({"extractor_mode": "layer_norm"})
    with pytest.raises(ValueError, match="layer_norm_first True"):
        WavLMConfig.from_dict({"layer_norm_first": True})
    with pytest.raises(ValueError, match="conv_feature_layers"):
        WavLMConfig(conv_feature_layers="[(1, 2)]").conv_layers
    with pytest.raises(ValueError):
        WavLMConfig(conv_feature_layers="__import__('os')").conv_layers  # parsed, never evaluated


def test_speech_features_are_two_tokens_a_frame_as_the_reference_pairs_them():
    from lipstream.keysync.speech import frames_of, hubert_features, piece_sizes, wavlm_features

    frames = frames_of(torch.randn(640 * 7 + 100))  # 7 frames and a bit: 8, the last padded
    assert frames.shape == (8, 640) and torch.all(frames[-1, 100:] == 0)
    seen = []

    def encoder(wave):  # stands for HuBERT / WavLM: a token every 320 samples, after a 400-sample window
        seen.append(wave)
        n = (wave.shape[1] - 400) // 320 + 1
        return torch.arange(n, dtype=torch.float32)[None, :, None].expand(1, n, 3) + 1

    hubert = hubert_features(encoder, frames)
    assert hubert.shape == (8, 2, 3) and torch.all(hubert[-1, 1] == 0)  # 15 tokens and a zero one
    assert torch.equal(hubert[:, 0, 0], torch.arange(1, 16, 2, dtype=torch.float32))
    wave = seen[0][0]
    assert abs(float(wave.mean())) < 1e-5 and abs(float(wave.std()) - 1) < 1e-3  # normalised first
    seen.clear()
    wavlm = wavlm_features(encoder, frames[:7])  # odd: a zero frame appended
    assert wavlm.shape == (8, 2, 3)
    assert torch.equal(seen[0][0, -640:], torch.zeros(640)) and torch.equal(seen[0][0, :640], frames[0])
    # 15 tokens stretched to 16 by nearest: token i of 16 is token floor(i * 15 / 16)
    assert torch.equal(wavlm.flatten(0, 1)[:, 0], torch.tensor([i * 15 // 16 + 1 for i in range(16)],
                                                               dtype=torch.float32))
    assert piece_sizes(1500, 500) == [333, 333, 834] and piece_sizes(700000, 320000) == [190000, 510000]


# --- the schedule and the masks

def test_the_schedule_samples_keyframes_every_13_frames_in_clips_led_by_frame_0():
    from lipstream.keysync.schedule import plan

    s = plan(183)
    assert s.frames == 183 and len(s.chunks) == 1
    first, second = s.chunks[0].clips
    assert [x.frame for x in first] == [0, 0, 13, 26, 39, 52, 65, 78, 91, 104, 117, 130, 143, 156]
    assert [x.kept for x in first] == [False] + [True] * 13
    assert [x.frame for x in second] == [0, 169, 182] + [182] * 11
    assert [x.kept for x in second] == [False, True, True] + [False] * 11
    assert s.segments == [(13 * i, 13 * i + 13) for i in range(14)]
    assert plan(200).frames == 196  # frames after the last whole segment are not generated
    long = plan(650)
    assert long.frames == 638 and len(long.chunks) == 2 and len(long.segments) == 49
    # the second chunk starts where the first ended: its first segment begins at the carried keyframe
    assert long.chunks[0].segments[-1][1] == long.chunks[1].segments[0][0]
    with pytest.raises(ValueError, match="at least 14 frames, not 13"):
        plan(13)


def test_box_masks_cover_the_lower_face_from_the_nose_bridge_down():
    import numpy as np

    from lipstream.keysync.schedule import box_masks

    points = np.full((1, 68, 2), 256.0)
    points[0, :, 0] = np.linspace(100.7, 300.2, 68)  # x from 100 to 300
    points[0, 28, 1] = 200.9  # the nose bridge at row 200
    mask = box_masks(points)[0]
    rows, cols = np.nonzero(mask)
    assert rows.min() == 25 and rows.max() == 63  # 8 * 25 = 200 is the first sampled row at or below 200
    assert cols.min() == 13 and cols.max() == 37  # 104 ... 296: the sampled columns within [100, 300]


@pytest.mark.skipif(ref.checkout() is None, reason=f"no KeySync checkout: set {ref.ENV_VAR}")
@pytest.mark.parametrize("frames", [14, 27, 28, 183, 200, 365, 366, 378, 650])
def test_the_schedule_and_masks_equal_the_reference_pipeline_inputs(frames):
    import numpy as np

    from lipstream.keysync.schedule import box_masks, plan

    pipeline, = ref.load("scripts.sampling.dubbing_pipeline")
    marks = torch.arange(frames, dtype=torch.float32)  # each frame's speech and latent carry its number
    landmarks = np.random.default_rng(frames).uniform(100, 400, (frames, 68, 2))
    out = pipeline.create_pipeline_inputs(torch.zeros(frames, 3, 512, 512), marks[:, None, None], marks[:, None, None],
                                          14, marks[:, None, None, None].expand(frames, 4, 2, 2), landmarks,
                                          overlap=1, add_zero_flag=True, what_mask="box", nose_index=28)
    _, _, _, keyframe_speech, _, _, _, segment_masks, to_remove, segments, slot_frames = out
    s = plan(frames)
    slots = [x for chunk in s.chunks for clip in chunk.clips for x in clip]
    assert [x.frame for x in slots] == [int(a[0, 0]) for a in keyframe_speech][:len(slots)]
    assert [not x.kept for x in slots] == to_remove[:len(slots)]
    assert s.segments == [tuple(p) for p in segments]
    ours = box_masks(landmarks)
    for k, (a, _) in enumerate(segments):
        assert np.array_equal(segment_masks[k][:, 0].numpy(), ours[a:a + 14])
    # the reference's walk over chunks of two clips (dubbing_pipeline.sample): which segments each interpolates
    ids = [slot_frames[i:i + 14] for i in range(0, len(slot_frames), 14)]
    carried, walked = None, []
    for c in range(0, len(ids), 2):
        own = [i for clip in ids[c:c + 2] for i in clip]
        seen = ([carried] if carried is not None else []) + own
        carried = own[-1]
        first = next(i for i in seen if i is not None)
        last = next(i for i in reversed(seen) if i is not None)
        start = next((n for n, p in enumerate(segments) if p[0] == first), None)
        if start is None:
            break
        end = len(segments) - next(n for n, p in enumerate(reversed(segments)) if p[1] == last)
        walked.append([tuple(p) for p in segments[start:end]])
    assert [list(chunk.segments) for chunk in s.chunks] == walked


# --- the pipeline: chunks of keyframes and the frames between, decoded

def _tiny_networks():
    from lipstream.keysync.pipeline import KeySyncNetworks
    from lipstream.models.svd_vae import SVDVAE, SVDVAEConfig

    torch.manual_seed(0)
    interpolation = type(TINY)(**{**TINY.to_dict(), "in_channels": 9})
    return KeySyncNetworks(KeySyncNet(TINY, latent_size=8).eval(), KeySyncNet(interpolation, latent_size=8).eval(),
                           SVDVAE(SVDVAEConfig(block_out_channels=(32,) * 4, layers_per_block=1)).eval())


def test_the_pipeline_gives_every_scheduled_frame_once_in_order_across_chunks():
    from lipstream.keysync.options import KeySyncOptions
    from lipstream.keysync.pipeline import Inputs, generate
    from lipstream.keysync.schedule import plan

    nets = _tiny_networks()
    frames = 380  # two chunks: the second starts at the first's last keyframe
    g = torch.Generator().manual_seed(5)
    inputs = Inputs(torch.randn(frames, 4, 8, 8, generator=g), (torch.rand(frames, 1, 8, 8, generator=g) > 0.5).float(),
                    torch.randn(frames, 2, 768, generator=g), torch.randn(frames, 2, 768, generator=g))
    options = KeySyncOptions(interpolation_dtype="float32", clips_per_call=16)
    schedule = plan(frames)
    assert len(schedule.chunks) == 2
    parts = list(generate(nets, schedule, inputs, options))
    starts = [start for start, _ in parts]
    assert starts == sorted(starts) and starts[0] == 0
    assert all(a + p.shape[0] == b for (a, p), b in zip(parts, starts[1:]))  # no frame twice, none missing
    video = torch.cat([p for _, p in parts])
    assert video.shape == (schedule.frames, 3, 64, 64) and schedule.frames == 378
    assert video.min() >= 0 and video.max() <= 1
    short = plan(40)  # one chunk, three segments
    once = torch.cat([p for _, p in generate(nets, short, inputs, options)])
    again = torch.cat([p for _, p in generate(nets, short, inputs, options.replace(clips_per_call=1))])
    torch.testing.assert_close(again, once, rtol=1e-4, atol=1e-5)  # only the speed depends on the batching
    other = torch.cat([p for _, p in generate(nets, short, inputs, options.replace(seed=24))])
    assert (other - once).abs().max() > 1e-3  # the seed is the noise


# --- the published files, key for key

def _write_keysync_folder(root, models):
    """random_keysync's tiny networks written as KeySync's files are (models/layout.py's KEYSYNC_FILES)."""
    import types
    from collections import OrderedDict
    from dataclasses import asdict

    from safetensors.torch import save_file

    from lipstream.models.layout import KEYSYNC_FILES

    paths = [root / f.path for f in KEYSYNC_FILES]
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
    decoder = {"first_stage_model.decoder." + k: v for k, v in ref.sgm_decoder_state().items()}  # sgm's names
    for path, net in zip(paths[:2], (models.networks.keyframe, models.networks.interpolation)):
        module = {"_forward_module." + k: v for k, v in {**net.state_dict(), **decoder}.items()}
        module["_forward_module.first_stage_model.encoder.conv_in.weight"] = torch.zeros(2, 2)  # never read
        torch.save({"module": module, "buffer_names": [], "ds_version": "0.14.0", "global_steps": 1000,
                    "param_shapes": [OrderedDict((k, v.shape) for k, v in net.state_dict().items())],
                    "client_state": types.SimpleNamespace(note="an object the restricted reader must not build")},
                   path)
    cfg = {**asdict(models.wavlm.config), "extractor_mode": "default", "relative_position_embedding": True,
           "gru_rel_pos": True, "mask_prob": 0.65, "dropout": 0.1}
    torch.save({"cfg": cfg, "model": models.wavlm.state_dict()}, paths[2])
    hubert = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(models.hubert.config).items()}
    paths[3].write_text(json.dumps({**hubert, "architectures": ["HubertModel"], "model_type": "hubert"}))
    save_file(models.hubert.state_dict(), str(paths[4]))
    vae = _sgm_decoded_vae()  # the SVD VAE's files: its shapes those of the sgm decoder in the checkpoints
    paths[5].write_text(json.dumps({"_class_name": "AutoencoderKLTemporalDecoder", "layers_per_block": 2,
                                    "block_out_channels": [32, 32, 64, 64], "latent_channels": 4}))
    with torch.no_grad():
        for name, t in vae.state_dict().items():
            if name.startswith("decoder."):
                t.add_(1.0)  # the folder's decoder differs from the checkpoint's: the checkpoint's must win
    save_file({k: v.half() for k, v in vae.state_dict().items()}, str(paths[6]))
    return paths


def test_keysync_loads_its_published_files_key_for_key(tmp_path):
    from lipstream.keysync.load import load_keysync, random_keysync

    models = random_keysync("tiny", "cpu", seed=7)
    _write_keysync_folder(tmp_path, models)
    loaded = load_keysync(tmp_path, "cpu", size="tiny")
    for a, b in ((models.networks.keyframe, loaded.networks.keyframe),
                 (models.networks.interpolation, loaded.networks.interpolation),
                 (models.hubert, loaded.hubert), (models.wavlm, loaded.wavlm)):
        mine, theirs = a.state_dict(), b.state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    vae = loaded.networks.vae.state_dict()  # run in fp32
    assert all(v.dtype == torch.float32 for v in vae.values())
    from lipstream.models.svd_vae import decoder_from_sgm

    mine = {**_sgm_decoded_vae().state_dict(), **decoder_from_sgm(ref.sgm_decoder_state(), 4)}
    assert all(torch.equal(v, mine[k] if k.startswith("decoder.") else mine[k].half().float()) for k, v in vae.items())
    assert loaded.size == models.size == 128


def test_keysync_file_errors_are_one_line_and_name_the_file(tmp_path):
    from lipstream.errors import WeightsError
    from lipstream.keysync.load import load_keysync, random_keysync

    models = random_keysync("tiny", "cpu")
    paths = _write_keysync_folder(tmp_path, models)
    keyframe, interpolation = paths[0], paths[1]
    paths[2].unlink()
    with pytest.raises(WeightsError, match=r"missing .*WavLM-Base\+\.pt.*weights download") as e:
        load_keysync(tmp_path, "cpu", size="tiny")
    assert "\n" not in str(e.value)
    _write_keysync_folder(tmp_path, models)
    swapped = keyframe.read_bytes()
    keyframe.write_bytes(interpolation.read_bytes())
    with pytest.raises(WeightsError, match="holds the interpolation model, not the keyframe one"):
        load_keysync(tmp_path, "cpu", size="tiny")
    keyframe.write_bytes(swapped[: len(swapped) // 2])
    with pytest.raises(WeightsError, match="keyframe_dub.pt: cannot read weights"):
        load_keysync(tmp_path, "cpu", size="tiny")
    keyframe.write_bytes(swapped)
    with pytest.raises(WeightsError, match="keyframe_dub.pt: does not match its config: .*other shapes"):
        load_keysync(tmp_path, "cpu", size="full")  # tiny files where the published shapes are expected


def _sgm_decoded_vae():
    from lipstream.models.svd_vae import SVDVAE, SVDVAEConfig, decoder_from_sgm

    torch.manual_seed(8)  # the encoder: the same in every call
    vae = SVDVAE(SVDVAEConfig(block_out_channels=(32, 32, 64, 64), layers_per_block=2)).eval()
    mapped = decoder_from_sgm(ref.sgm_decoder_state(), levels=4)
    assert set(mapped) == {k for k in vae.state_dict() if k.startswith("decoder.")}  # every tensor, no other
    vae.load_state_dict({**vae.state_dict(), **mapped}, strict=True)
    return vae


def test_keysyncs_own_decoder_under_sgm_names_equals_sgm_videodecoder():
    """KeySync's checkpoints hold the VAE decoder it decodes with under sgm's names: renamed (the attention's
    1x1 convolutions as linear layers), it decodes as sgm's VideoDecoder does, a frame at a time and by clips."""
    vae = _sgm_decoded_vae()
    z = torch.randn(6, 4, 4, 4, generator=torch.Generator().manual_seed(6))
    golden = load_file(GOLDEN)
    with torch.no_grad():
        for frames in (1, 3):
            got = vae.decode(z, frames=frames)
            torch.testing.assert_close(got, golden[f"sgm_decoder_{frames}"], rtol=1e-4, atol=1e-4)
            if ref.checkout() is not None:
                decoder = ref.sgm_decoder()
                decoder.load_state_dict(ref.sgm_decoder_state(), strict=True)
                torch.testing.assert_close(got, decoder(z, timesteps=frames), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("frames", [1, 2, 5])
def test_the_time_convolution_is_conv3d_over_three_frames(frames):
    from lipstream.models.svd_vae import TimeConv

    torch.manual_seed(0)
    conv = TimeConv(6, 8)
    x = torch.randn(2, 6, frames, 5, 7)
    want = torch.nn.functional.conv3d(x, conv.weight, conv.bias, padding=(1, 0, 0))
    torch.testing.assert_close(conv(x), want, rtol=1e-5, atol=1e-6)


def test_the_fast_preset_samples_with_a_cast_copy_and_leaves_the_fp32_weights():
    """autocast=False: the UNets' weights cast once to the preset's dtype (a copy, kept for the next call); the
    frames stay close to fp32's, and the networks the reference preset samples under autocast are untouched."""
    from lipstream.keysync.options import KeySyncOptions
    from lipstream.keysync.pipeline import Inputs, generate
    from lipstream.keysync.schedule import plan

    nets = _tiny_networks()
    g = torch.Generator().manual_seed(5)
    frames = 14  # one keyframe clip, one segment
    inputs = Inputs(torch.randn(frames, 4, 8, 8, generator=g), (torch.rand(frames, 1, 8, 8, generator=g) > 0.5).float(),
                    torch.randn(frames, 2, 768, generator=g), torch.randn(frames, 2, 768, generator=g))
    fp32 = KeySyncOptions(interpolation_dtype="float32")
    cast = fp32.replace(keyframe_dtype="bfloat16", interpolation_dtype="bfloat16", autocast=False)
    want = torch.cat([p for _, p in generate(nets, plan(frames), inputs, fp32)])
    got = torch.cat([p for _, p in generate(nets, plan(frames), inputs, cast)])
    assert (got - want).abs().mean() < 0.05 and (got - want).abs().max() > 0  # bf16's rounding, no more
    assert nets.keyframe.unet.time_embed[0].weight.dtype == torch.float32
    assert len(nets._copies) == 2 and all(n.unet.time_embed[0].weight.dtype == torch.bfloat16
                                          for n in nets._copies.values())


def test_decoding_in_bf16_stays_close_to_fp32_and_keeps_the_fp32_vae():
    from lipstream.keysync.options import KEYSYNC_PRESETS, KeySyncOptions
    from lipstream.keysync.pipeline import Inputs, generate
    from lipstream.keysync.schedule import plan

    nets = _tiny_networks()
    g = torch.Generator().manual_seed(5)
    frames = 14
    inputs = Inputs(torch.randn(frames, 4, 8, 8, generator=g), (torch.rand(frames, 1, 8, 8, generator=g) > 0.5).float(),
                    torch.randn(frames, 2, 768, generator=g), torch.randn(frames, 2, 768, generator=g))
    fp32 = KeySyncOptions(interpolation_dtype="float32", steps=6, guidance_until=0.5)
    want = torch.cat([p for _, p in generate(nets, plan(frames), inputs, fp32)])
    got = torch.cat([p for _, p in generate(nets, plan(frames), inputs, fp32.replace(decode_dtype="bfloat16"))])
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert 0 < (got - want).abs().mean() < 0.02  # bf16's rounding in the decoder, no more
    assert nets.vae.decoder.conv_in.weight.dtype == torch.float32
    draft = KEYSYNC_PRESETS["draft"]
    assert (draft.steps, draft.guidance_until, draft.decode_dtype) == (6, 0.5, "bfloat16")
    assert KEYSYNC_PRESETS["fast"].decode_dtype == "bfloat16" and KEYSYNC_PRESETS["reference"].decode_dtype == "float32"
    assert draft.for_device("cpu").decode_dtype == "float32"
    with pytest.raises(ValueError, match="guidance_until"):
        draft.replace(guidance_until=-1.0).check()


def test_one_clip_chunks_keep_the_clips_and_segments_and_bring_frames_sooner():
    from lipstream.keysync.schedule import plan

    two, one = plan(650), plan(650, chunk=1)
    clips = lambda s: [clip for c in s.chunks for clip in c.clips]  # noqa: E731
    assert clips(one) == clips(two) and one.segments == two.segments and one.frames == two.frames
    assert len(one.chunks) == 4 and len(two.chunks) == 2
    assert len(one.chunks[0].segments) == 12 < len(two.chunks[0].segments) == 25
