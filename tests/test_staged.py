"""models/staged.py: a safetensors file read through the staging ring gives load_file's tensors, bit for bit."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from lipstream.models import staged


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"unet.w": torch.randn(33, 17, generator=g).half(), "vae.b": torch.randn(5, generator=g),
            "pe": torch.randn(2, 3, 4, generator=g, dtype=torch.float64), "bf": torch.randn(9, generator=g).bfloat16(),
            "idx": torch.arange(7), "mask": torch.tensor([True, False, True]), "bytes": torch.arange(11, dtype=torch.uint8),
            "empty": torch.zeros(0, 4)}


@pytest.mark.parametrize("readers", [1, 3])
@pytest.mark.parametrize("chunk", [16, 100, 1 << 20])  # many chunks round each reader's buffers, a few, one
def test_staged_read_equals_load_file(tmp_path, monkeypatch, chunk, readers):
    monkeypatch.setattr(staged, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(staged, "READERS", readers)
    path = tmp_path / "w.safetensors"
    save_file(_tensors(), str(path), metadata={"origin": "test"})
    want = load_file(str(path))
    got = staged.load_to_device(path, torch.device("cpu"), staged=True)
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name], t), name
    assert staged.read_header(path)[1] == {"origin": "test"}
    assert staged.load_with_metadata(path, torch.device("cpu"))[0] == {"origin": "test"}  # load_file's path too


def _write_raw(path, entries: dict[str, tuple[str, list[int], bytes]], pad_to: int = 8) -> None:
    """A safetensors file laid out exactly as given (the writer's own alignment not assumed)."""
    header, data = {}, b""
    for name, (dtype, shape, raw) in entries.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % pad_to)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("chunk", [5, 1 << 20])  # tensors split across chunks, or one chunk
def test_every_tensor_starts_aligned_on_the_device_whatever_the_file_offsets(tmp_path, monkeypatch, chunk):
    """A 3-byte tensor first puts the next at file offset 3; on the device each starts at a multiple of ALIGN
    (compiled kernels assume aligned weights), with the file's bytes."""
    monkeypatch.setattr(staged, "CHUNK_BYTES", chunk)
    values = torch.tensor([1.5, -2.25, 3.0], dtype=torch.float32)
    halves = torch.arange(5, dtype=torch.float16)
    path = tmp_path / "odd.safetensors"
    _write_raw(path, {"a": ("U8", [3], bytes([1, 2, 3])), "b": ("F32", [3], values.numpy().tobytes()),
                      "c": ("F16", [5], halves.numpy().tobytes())})
    got = staged.load_to_device(path, torch.device("cpu"), staged=True)
    assert torch.equal(got["b"], values) and got["a"].tolist() == [1, 2, 3] and torch.equal(got["c"], halves)
    base = got["a"].data_ptr()
    assert [(t.data_ptr() - base) % staged.ALIGN for t in got.values()] == [0, 0, 0]
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1  # one allocation


def test_a_short_file_or_an_unknown_dtype_is_one_clear_error(tmp_path):
    path = tmp_path / "short.safetensors"
    save_file({"w": torch.ones(1000)}, str(path))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ValueError, match="ends 100 bytes before its tensors do"):  # one chunk, one reader
        staged.load_to_device(path, torch.device("cpu"), staged=True)
    _write_raw(path, {"q": ("F8_E4M3", [2], b"\0\0")})
    with pytest.raises(ValueError, match="dtype F8_E4M3"):
        staged.load_to_device(path, torch.device("cpu"), staged=True)
    path.write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(ValueError, match="not a safetensors file"):
        staged.load_to_device(path, torch.device("cpu"), staged=True)


def test_a_failing_ring_falls_back_to_load_file(tmp_path, monkeypatch, caplog):
    """Pinned memory or a stream that fails (a RuntimeError from torch) is not the file's fault: load_file."""
    path = tmp_path / "w.safetensors"
    save_file(_tensors(), str(path), metadata={"origin": "test"})

    def broken(*args, **kwargs):
        raise RuntimeError("CUDA error: out of pinned memory")

    monkeypatch.setattr(staged, "_read_into", broken)
    meta, got = staged.load_with_metadata(path, torch.device("cpu"), staged=True)
    assert meta == {"origin": "test"} and "staged read" in caplog.text
    for name, t in load_file(str(path)).items():
        assert torch.equal(got[name], t), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the pinned ring and its copy stream need a GPU")
def test_staged_read_onto_the_gpu_equals_load_file(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(staged, "CHUNK_BYTES", 64)
    monkeypatch.setattr(staged, "READERS", 3)
    path = tmp_path / "w.safetensors"
    save_file(_tensors(), str(path))
    want = load_file(str(path), device="cuda")
    got = staged.load_to_device(path, torch.device("cuda"))
    for name, t in want.items():
        assert got[name].device.type == "cuda" and torch.equal(got[name], t), name
    assert "staged read" not in caplog.text  # the ring itself, not load_file's fallback
    assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1
