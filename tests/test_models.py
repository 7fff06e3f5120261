"""Model building and loading: the upstream checkpoint layout round-trips strictly, errors are one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from lipstream.errors import WeightsError
from lipstream.models import PositionalEncoding, load_musetalk, model_config
from lipstream.models.build import build_unet, build_vae, build_whisper_encoder
from lipstream.models.checkpoint import read_state_dict, rename_old_vae_attention
from lipstream.models.config import UNET_FULL, VAE_FULL, WHISPER_FULL
from lipstream.models.export import write_random_checkpoint

UPSTREAM_FILES = [
    "musetalkV15/unet.pth", "musetalkV15/musetalk.json",
    "sd-vae/config.json", "sd-vae/diffusion_pytorch_model.bin",
    "whisper/config.json", "whisper/pytorch_model.bin", "whisper/preprocessor_config.json",
]


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 8, 32, 32, generator=g), torch.randn(2, 50, 384, generator=g),
            torch.rand(2, 3, 256, 256, generator=g) * 2 - 1, torch.randn(1, 80, 3000, generator=g))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference against the reference's largest magnitude."""
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1e-30))


def run_all(m, seed=1):
    """Deterministic forward passes through every network."""
    latents, audio, image, mel = _inputs(seed)
    with torch.inference_mode():
        return {"unet": m.unet(latents, m.pe(audio)), "decoded": m.vae.decode(latents[:, :4] / 0.18215),
                "encoded": m.vae.encode(image), "hidden": m.whisper(mel)}


def run_reference(unet, vae, whisper, seed=1):
    """The same passes through diffusers' and transformers' modules."""
    latents, audio, image, mel = _inputs(seed)
    with torch.inference_mode():
        return {"unet": unet(latents, 0, encoder_hidden_states=PositionalEncoding()(audio)).sample,
                "decoded": vae.decode(latents[:, :4] / 0.18215).sample, "encoded": vae.encode(image).latent_dist.mean,
                "hidden": torch.stack(whisper(mel, output_hidden_states=True).hidden_states, 2)}


def test_full_architectures_have_upstream_sizes():
    """Built on the meta device: no memory, exact parameter counts of MuseTalk v1.5."""
    count = lambda net: sum(p.numel() for p in net.parameters())  # noqa: E731
    unet = build_unet(UNET_FULL)
    assert count(unet) == 849_947_844
    assert unet.conv_in.in_channels == 8 and unet.config.cross_attention_dim == 384
    assert count(build_vae(VAE_FULL)) == 83_653_863
    whisper = build_whisper_encoder(WHISPER_FULL)
    assert count(whisper) == 8_208_384 and len(whisper.layers) == 4


def test_tiny_preset_keeps_every_pipeline_shape(tiny_models):
    out = run_all(tiny_models)
    assert out["unet"].shape == (2, 4, 32, 32)
    assert out["decoded"].shape == (2, 3, 256, 256)
    assert out["encoded"].shape == (2, 4, 32, 32)
    assert out["hidden"].shape == (1, 1500, 5, 384)
    assert all(torch.isfinite(v).all() for v in out.values())


def test_random_weights_are_seeded_and_announced(caplog):
    a = load_musetalk(random_weights=True, size="tiny", seed=3, components=["unet"])
    b = load_musetalk(random_weights=True, size="tiny", seed=3, components=["unet"])
    c = load_musetalk(random_weights=True, size="tiny", seed=4, components=["unet"])
    assert a.fingerprints == b.fingerprints != c.fingerprints
    assert a.random_weights and a.vae is None and a.whisper is None
    assert "RANDOM WEIGHTS" in caplog.text


def test_checkpoint_round_trip_is_exact(tiny_checkpoint, tiny_models):
    for rel in UPSTREAM_FILES:
        assert (tiny_checkpoint / rel).is_file(), rel
    assert json.loads((tiny_checkpoint / "musetalkV15/musetalk.json").read_text()) == model_config("tiny").unet
    loaded = load_musetalk(tiny_checkpoint, device="cpu")
    assert not loaded.random_weights
    assert loaded.fingerprints == tiny_models.fingerprints
    want, got = run_all(tiny_models), run_all(loaded)
    for k in want:
        assert torch.equal(want[k], got[k]), k


@pytest.mark.slow
def test_safetensors_layout_round_trips(tmp_path, tiny_models):
    root = write_random_checkpoint(tmp_path, size="tiny", seed=0, binary=False)
    assert (root / "musetalkV15/unet.safetensors").is_file()
    assert (root / "sd-vae/diffusion_pytorch_model.safetensors").is_file()
    assert (root / "whisper/model.safetensors").is_file()
    loaded = load_musetalk(root)
    assert loaded.fingerprints == tiny_models.fingerprints
    # the same weights; safetensors' tensors are unaligned views of the file's buffer, where the CPU's
    # convolution kernels add in another order (cloned into aligned memory they give the same bits)
    torch.testing.assert_close(run_all(loaded)["unet"], run_all(tiny_models)["unet"], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_files_load_with_the_libraries_upstream_uses(tiny_checkpoint, tiny_models):
    """The folder is a genuine diffusers / transformers folder, unet.pth loads as upstream does, and the
    libraries' modules compute what LipStream's own compute from the same files."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import WhisperModel

    cfg = json.loads((tiny_checkpoint / "musetalkV15/musetalk.json").read_text())
    unet = UNet2DConditionModel(**{k: v for k, v in cfg.items() if not k.startswith("_")})
    unet.load_state_dict(torch.load(tiny_checkpoint / "musetalkV15/unet.pth", weights_only=True))
    vae = AutoencoderKL.from_pretrained(tiny_checkpoint / "sd-vae")
    whisper = WhisperModel.from_pretrained(tiny_checkpoint / "whisper").encoder
    want, got = run_all(tiny_models), run_reference(unet.eval(), vae.eval(), whisper.eval())
    for k in want:
        assert relative_error(got[k], want[k]) < 1e-5, k


def test_old_vae_attention_names_are_converted(tmp_path, tiny_checkpoint, tiny_models):
    """sd-vae-ft-mse's .bin uses diffusers 0.4 names (query/key/value/proj_attn)."""
    root = tmp_path / "m"
    shutil.copytree(tiny_checkpoint, root)
    sd = read_state_dict(root / "sd-vae/diffusion_pytorch_model.bin")
    old = {}
    for k, v in sd.items():
        for new, legacy in [(".to_q.", ".query."), (".to_k.", ".key."), (".to_v.", ".value."),
                            (".to_out.0.", ".proj_attn.")]:
            k = k.replace(new, legacy)
        old[k] = v
    assert any(".proj_attn." in k for k in old)
    assert rename_old_vae_attention(old).keys() == sd.keys()
    torch.save(old, root / "sd-vae/diffusion_pytorch_model.bin")
    loaded = load_musetalk(root, components=["vae"])
    assert loaded.fingerprints["vae"] == tiny_models.fingerprints["vae"]


def test_positional_encoding_is_the_sinusoid():
    pe = PositionalEncoding()
    x = torch.zeros(1, 50, 384)
    y = pe(x)[0]
    assert torch.equal(y[0, 0::2], torch.zeros(192)) and torch.equal(y[0, 1::2], torch.ones(192))
    assert torch.allclose(y[7, 0], torch.tensor(7.0).sin()) and torch.allclose(y[7, 1], torch.tensor(7.0).cos())
    assert torch.allclose(y[3, 2], torch.tensor(3 * 10000 ** (-2 / 384)).sin())
    assert not list(pe.state_dict())  # nothing to load from a checkpoint


# ---- errors: one line, naming the file and what to do ----

def _broken(tmp_path, tiny_checkpoint):
    root = tmp_path / "models"
    shutil.copytree(tiny_checkpoint, root)
    return root


def _one_line_error(root, match, components=("unet", "vae", "whisper")):
    with pytest.raises(WeightsError, match=match) as info:
        load_musetalk(root, components=components)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_missing_folder(tmp_path):
    msg = _one_line_error(tmp_path / "nowhere", "does not exist")
    assert "lipstream weights download" in msg and str(tmp_path / "nowhere") in msg


@pytest.mark.parametrize("rel", ["musetalkV15/unet.pth", "musetalkV15/musetalk.json", "sd-vae/config.json",
                                 "sd-vae/diffusion_pytorch_model.bin", "whisper/pytorch_model.bin",
                                 "whisper/preprocessor_config.json"])
def test_missing_file(tmp_path, tiny_checkpoint, rel):
    root = _broken(tmp_path, tiny_checkpoint)
    (root / rel).unlink()
    msg = _one_line_error(root, "missing")
    assert rel.split("/")[0] in msg and "lipstream weights download" in msg


def test_corrupt_weights(tmp_path, tiny_checkpoint):
    root = _broken(tmp_path, tiny_checkpoint)
    (root / "musetalkV15/unet.pth").write_bytes(b"\x00garbage" * 100)
    msg = _one_line_error(root, "cannot read weights")
    assert "unet.pth" in msg


def test_truncated_weights(tmp_path, tiny_checkpoint):
    root = _broken(tmp_path, tiny_checkpoint)
    data = (root / "whisper/pytorch_model.bin").read_bytes()
    (root / "whisper/pytorch_model.bin").write_bytes(data[: len(data) // 2])
    _one_line_error(root, r"pytorch_model.bin: cannot read weights.*corrupt or incomplete")


def test_truncated_safetensors(tmp_path):
    root = write_random_checkpoint(tmp_path, size="tiny", binary=False)
    path = root / "sd-vae/diffusion_pytorch_model.safetensors"
    path.write_bytes(path.read_bytes()[:5000])
    _one_line_error(root, "diffusion_pytorch_model.safetensors: cannot read weights")


def _set_config(path, key: str, value) -> None:
    cfg = json.loads(path.read_text())
    cfg[key] = value
    path.write_text(json.dumps(cfg))


def test_config_mismatch_names_the_tensor(tmp_path, tiny_checkpoint):
    root = _broken(tmp_path, tiny_checkpoint)
    _set_config(root / "musetalkV15/musetalk.json", "in_channels", 4)
    msg = _one_line_error(root, "does not match its config")
    assert "conv_in.weight" in msg and "[32, 8, 3, 3]" in msg


def test_missing_tensor_is_refused(tmp_path, tiny_checkpoint):
    root = _broken(tmp_path, tiny_checkpoint)
    sd = torch.load(root / "musetalkV15/unet.pth", weights_only=True)
    del sd["conv_out.bias"]
    torch.save(sd, root / "musetalkV15/unet.pth")
    _one_line_error(root, r"1 tensors missing \(e.g. conv_out.bias\)")


def test_invalid_json(tmp_path, tiny_checkpoint):
    root = _broken(tmp_path, tiny_checkpoint)
    (root / "sd-vae/config.json").write_text("{not json")
    _one_line_error(root, "config.json: not a valid JSON config")


def test_not_whisper_tiny(tmp_path, tiny_checkpoint):
    root = _broken(tmp_path, tiny_checkpoint)
    _set_config(root / "whisper/config.json", "encoder_layers", 6)
    _one_line_error(root, "needs whisper-tiny", components=["whisper"])


def test_pickled_code_is_refused(tmp_path, tiny_checkpoint):
    """A checkpoint that would run code on load is rejected by weights_only, never executed."""
    root = _broken(tmp_path, tiny_checkpoint)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    torch.save({"conv_in.weight": Evil()}, root / "musetalkV15/unet.pth")
    _one_line_error(root, "cannot read weights", components=["unet"])
    assert not marker.exists()


def test_models_dir_from_environment(tmp_path, tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("LIPSTREAM_MODELS", str(tiny_checkpoint))
    assert load_musetalk(components=["vae"]).vae is not None
    monkeypatch.setenv("LIPSTREAM_MODELS", str(tmp_path / "empty"))
    _one_line_error(None, "empty")
