"""LipStream's own networks compute what diffusers' and transformers' modules compute, from the same weights.

Those two libraries are the reference here (the test extra) and nowhere else: a render and a compile
run with both made unimportable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from lipstream.errors import WeightsError
from lipstream.models import PositionalEncoding, load_musetalk, model_config
from lipstream.models.build import build_unet, build_vae, build_whisper_encoder
from lipstream.models.whisper import mel_filters

diffusers = pytest.importorskip("diffusers", reason="the reference modules come with the test extra")
transformers = pytest.importorskip("transformers", reason="the reference modules come with the test extra")


def _public(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def reference_unet(cfg: dict, ours: torch.nn.Module) -> torch.nn.Module:
    """diffusers' UNet2DConditionModel holding our module's tensors (built on meta: no copy, no init)."""
    with torch.device("meta"):
        ref = diffusers.UNet2DConditionModel.from_config(_public(cfg))
    ref.load_state_dict(ours.state_dict(), strict=True, assign=True)
    return ref.eval()


def reference_vae(cfg: dict, ours: torch.nn.Module) -> torch.nn.Module:
    with torch.device("meta"):
        ref = diffusers.AutoencoderKL.from_config(_public(cfg))
    ref.load_state_dict(ours.state_dict(), strict=True, assign=True)
    return ref.eval()


def reference_whisper(cfg: dict, ours: torch.nn.Module) -> torch.nn.Module:
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = transformers.WhisperConfig(**_public(cfg))
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        ref = WhisperEncoder(config)
    ref.load_state_dict(ours.state_dict(), strict=True, assign=True)
    return ref.eval()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference against the reference's largest magnitude."""
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-30))


def _inputs(batch: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 8, 32, 32, generator=g).to(dtype), torch.randn(batch, 50, 384, generator=g).to(dtype),
            (torch.rand(batch, 3, 256, 256, generator=g) * 2 - 1).to(dtype),
            torch.randn(batch, 4, 32, 32, generator=g).to(dtype), torch.randn(1, 80, 3000, generator=g).to(dtype))


def compare(size: str, batch: int, dtype=torch.float32) -> dict[str, float]:
    """Each network's outputs, ours against the reference's on the same weights: relative errors."""
    cfg = model_config(size)
    unet = build_unet(cfg.unet, device="cpu", seed=0).to(dtype)
    vae = build_vae(cfg.vae, device="cpu", seed=1).to(dtype)
    whisper = build_whisper_encoder(cfg.whisper, device="cpu", seed=2).to(dtype)
    latents, windows, image, z, mel = _inputs(batch, dtype=dtype)
    audio = PositionalEncoding()(windows)
    errors = {}
    with torch.inference_mode():
        ref = reference_unet(cfg.unet, unet)
        errors["unet"] = relative_error(unet(latents, audio), ref(latents, 0, encoder_hidden_states=audio).sample)
        del ref
        ref = reference_vae(cfg.vae, vae)
        errors["vae encode"] = relative_error(vae.encode(image), ref.encode(image).latent_dist.mean)
        errors["vae decode"] = relative_error(vae.decode(z), ref.decode(z).sample)
        del ref
        ref = reference_whisper(cfg.whisper, whisper)
        errors["whisper"] = relative_error(whisper(mel), torch.stack(ref(mel, output_hidden_states=True).hidden_states,
                                                                     dim=2))
    return errors


@pytest.mark.slow
def test_tiny_networks_equal_the_reference_modules():
    errors = compare("tiny", batch=3)
    assert all(e <= 1e-5 for e in errors.values()), errors


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("LIPSTREAM_SKIP_FULL") == "1", reason="LIPSTREAM_SKIP_FULL=1")
def test_full_size_networks_equal_the_reference_modules():
    """The published architectures (850 M + 84 M + 8 M parameters), one sample each on the CPU."""
    errors = compare("full", batch=1)
    assert all(e <= 1e-5 for e in errors.values()), errors


@pytest.mark.slow
def test_half_precision_stays_as_close_to_fp32_as_the_reference_does():
    """fp16 (what the GPU runs): ours is as far from the fp32 answer as the reference's fp16 is, no further."""
    if not torch.cuda.is_available():
        try:
            torch.nn.functional.conv2d(torch.ones(1, 1, 3, 3, dtype=torch.float16), torch.ones(1, 1, 1, 1,
                                                                                             dtype=torch.float16))
        except RuntimeError:
            pytest.skip("no fp16 convolution on this CPU")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = model_config("tiny")
    unet = build_unet(cfg.unet, device="cpu", seed=0).to(device)
    vae = build_vae(cfg.vae, device="cpu", seed=1).to(device)
    latents, windows, _, z, _ = (t.to(device) for t in _inputs(2))
    audio = PositionalEncoding().to(device)(windows)
    with torch.inference_mode():
        want_u, want_d = unet(latents, audio), vae.decode(z)
        ref_u, ref_v = reference_unet(cfg.unet, unet).half(), reference_vae(cfg.vae, vae).half()
        theirs_u = ref_u(latents.half(), 0, encoder_hidden_states=audio.half()).sample
        theirs_d = ref_v.decode(z.half()).sample
        unet.half(), vae.half()
        ours_u, ours_d = unet(latents.half(), audio.half()), vae.decode(z.half())
    for ours, theirs, want in ((ours_u, theirs_u, want_u), (ours_d, theirs_d, want_d)):
        assert relative_error(ours, want) <= max(2 * relative_error(theirs, want), 1e-3)


def test_mel_filters_are_whisper_feature_extractors():
    np.testing.assert_allclose(mel_filters(), transformers.WhisperFeatureExtractor().mel_filters, rtol=0, atol=1e-12)
    assert mel_filters().shape == (201, 80)


def test_an_unsupported_config_is_one_line_naming_the_file_and_key(tmp_path, tiny_checkpoint):
    import shutil

    root = tmp_path / "m"
    shutil.copytree(tiny_checkpoint, root)
    cfg = json.loads((root / "musetalkV15/musetalk.json").read_text())
    (root / "musetalkV15/musetalk.json").write_text(json.dumps({**cfg, "use_linear_projection": True}))
    with pytest.raises(WeightsError, match=r"musetalk\.json: cannot build.*use_linear_projection") as e:
        load_musetalk(root, components=["unet"])
    assert "\n" not in str(e.value)
    cfg = json.loads((root / "sd-vae/config.json").read_text())
    (root / "sd-vae/config.json").write_text(json.dumps({**cfg, "up_block_types": ["AttnUpDecoderBlock2D"] * 4}))
    with pytest.raises(WeightsError, match=r"config\.json: cannot build.*AttnUpDecoderBlock2D"):
        load_musetalk(root, components=["vae"])


BLOCKED = """
import atexit, json, os, sys
for name in ("diffusers", "transformers"):
    sys.modules[name] = None  # `import diffusers` now raises ImportError
def report(path=sys.argv[1]):
    loaded = sorted(m for m, v in sys.modules.items() if m.split(".")[0] in ("diffusers", "transformers") and v)
    open(path, "w").write(json.dumps(loaded))
atexit.register(report)
_exit = os._exit
def exit_after_report(code):  # a finished render ends with os._exit, which skips atexit
    report()
    _exit(code)
os._exit = exit_after_report
sys.argv = ["lipstream", *sys.argv[2:]]
from lipstream.cli import entry
entry()
"""


def test_compile_and_render_run_with_diffusers_and_transformers_unimportable(tmp_path, tiny_checkpoint):
    from lipstream.fixtures import speech_like, write_audio
    from lipstream.fixtures.avatar import action_loop

    from lipstream.avatar.boxes import TEMPLATE_LANDMARKS

    truth = action_loop(tmp_path / "anchor.mp4", width=480, height=270, seconds=0.4, fps=10)
    points = np.einsum("nij,kj->nki", truth.transforms[:, :, :2], TEMPLATE_LANDMARKS) + truth.transforms[:, None, :, 2]
    (tmp_path / "track.json").write_text(json.dumps({"landmarks": points.round(2).tolist()}))  # no dlib needed
    write_audio(tmp_path / "hello.wav", speech_like(0.5, 16000), 16000)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "COLUMNS": "200"}
    runs = [("compile", tmp_path / "anchor.mp4", "-o", tmp_path / "avatars", "--track", tmp_path / "track.json"),
            ("render", "--avatar", "anchor", "--avatars", tmp_path / "avatars", "--audio", tmp_path / "hello.wav",
             "-o", tmp_path / "out.mp4")]
    for i, args in enumerate(runs):
        seen = tmp_path / f"imported{i}.json"
        r = subprocess.run([sys.executable, "-c", BLOCKED, seen, *map(str, args), "--models", tiny_checkpoint,
                            "--device", "cpu"], capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 0, r.stderr
        assert json.loads(seen.read_text()) == []
    import av

    with av.open(str(tmp_path / "out.mp4")) as f:
        assert sum(1 for _ in f.decode(video=0)) == 5  # 0.5 s at the loop's 10 fps


def test_the_package_requires_neither_library_and_the_test_extra_does():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {r.split(">")[0].split("=")[0].split("[")[0].split("<")[0].strip() for r in reqs}  # noqa: E731
    assert not names(project["dependencies"]) & {"diffusers", "transformers"}
    assert {"diffusers", "transformers"} <= names(project["optional-dependencies"]["test"])
