"""DWPose in plain torch: the published checkpoint's keys, its loading, the pre- and post-processing, and
equality with the mmdet / mmpose modules MuseTalk builds it from (tests/dwpose_reference.py says how to
get them; without them those tests skip)."""

from __future__ import annotations

import collections
import pickle

import cv2
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from lipstream.errors import WeightsError
from lipstream.models.build import build_dwpose
from lipstream.models.dwpose import (
    FACE, FLIP_INDICES, INPUT_HEIGHT, INPUT_WIDTH, MEAN, STD, boxes_to_center_scale, crop, decode_simcc,
    dwpose_config, face_landmarks, flip_test, keypoints, to_frame)
from lipstream.models.load import load_dwpose


def expected_full_keys() -> dict[str, tuple[int, ...]]:
    """The published checkpoint's state_dict, written out from its structure (not from our module)."""
    keys: dict[str, tuple[int, ...]] = {}

    def cba(prefix: str, cin: int, cout: int, k: int, groups: int = 1) -> None:
        keys[f"backbone.{prefix}.conv.weight"] = (cout, cin // groups, k, k)
        for name in ("weight", "bias", "running_mean", "running_var"):
            keys[f"backbone.{prefix}.bn.{name}"] = (cout,)
        keys[f"backbone.{prefix}.bn.num_batches_tracked"] = ()

    cba("stem.0", 3, 32, 3), cba("stem.1", 32, 32, 3), cba("stem.2", 32, 64, 3)
    for i, (cin, c, n) in enumerate([(64, 128, 3), (128, 256, 6), (256, 512, 6), (512, 1024, 3)]):
        stage = f"stage{i + 1}"
        cba(f"{stage}.0", cin, c, 3)
        if i == 3:
            cba(f"{stage}.1.conv1", c, c // 2, 1), cba(f"{stage}.1.conv2", 2 * c, c, 1)
        s, m = f"{stage}.{2 if i == 3 else 1}", c // 2
        cba(f"{s}.main_conv", c, m, 1), cba(f"{s}.short_conv", c, m, 1), cba(f"{s}.final_conv", c, c, 1)
        for j in range(n):
            cba(f"{s}.blocks.{j}.conv1", m, m, 3)
            cba(f"{s}.blocks.{j}.conv2.depthwise_conv", m, m, 5, groups=m)
            cba(f"{s}.blocks.{j}.conv2.pointwise_conv", m, m, 1)
        keys[f"backbone.{s}.attention.fc.weight"] = (c, c, 1, 1)
        keys[f"backbone.{s}.attention.fc.bias"] = (c,)
    keys.update({"head.final_layer.weight": (133, 1024, 7, 7), "head.final_layer.bias": (133,),
                 "head.mlp.0.g": (1,), "head.mlp.1.weight": (256, 108), "head.gau.gamma": (2, 128),
                 "head.gau.beta": (2, 128), "head.gau.o.weight": (256, 512), "head.gau.uv.weight": (1152, 256),
                 "head.gau.ln.g": (1,), "head.gau.res_scale.scale": (256,), "head.cls_x.weight": (576, 256),
                 "head.cls_y.weight": (768, 256)})
    return keys


@pytest.fixture(scope="module")
def tiny():
    return build_dwpose("tiny", device="cpu", seed=0)


def _mmengine_checkpoint(path, sd, **extra) -> None:
    """Written as mmengine's runner writes one: meta (numpy inside), the weights, the message hub..."""
    torch.save({"meta": {"epoch": 270, "seed": np.int64(0), "dataset_meta": {"flip_indices": list(FLIP_INDICES)},
                         "stats": np.zeros(3)},
                "state_dict": collections.OrderedDict(sd), "message_hub": {"log_scalars": collections.Counter(a=1)},
                **extra}, path)


def test_full_size_has_the_published_checkpoints_470_keys_and_shapes():
    net = build_dwpose("full")  # meta: no memory, no time
    got = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    assert got == expected_full_keys() and len(got) == 470
    assert sum(p.numel() for p in net.backbone.parameters()) == 26_138_912
    assert sum(p.numel() for p in net.head.parameters()) == 7_472_007
    assert {m.eps for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)} == {1e-5}


def test_tiny_forward_gives_simcc_logits_of_every_keypoint(tiny):
    x = torch.randn(2, 3, INPUT_HEIGHT, INPUT_WIDTH)
    with torch.inference_mode():
        sx, sy = tiny(x)
        assert tiny.backbone(x).shape == (2, 128, 12, 9)
    assert sx.shape == (2, 133, 576) and sy.shape == (2, 133, 768)
    assert torch.isfinite(sx).all() and sx.std() > 0


def test_random_weights_are_seeded(tiny):
    again = build_dwpose("tiny", device="cpu", seed=0).state_dict()
    other = build_dwpose("tiny", device="cpu", seed=1).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in tiny.state_dict().items())
    assert not torch.equal(tiny.state_dict()["head.gau.gamma"], other["head.gau.gamma"])


def test_an_mmengine_checkpoint_and_a_safetensors_file_load_key_for_key(tmp_path, tiny):
    sd = tiny.state_dict()
    _mmengine_checkpoint(tmp_path / "dw.pth", sd, ema_state_dict={"module." + k: v for k, v in sd.items()})
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "dw.safetensors")
    x = torch.randn(1, 3, INPUT_HEIGHT, INPUT_WIDTH)
    with torch.inference_mode():
        want = tiny(x)
        for name in ("dw.pth", "dw.safetensors"):
            net = load_dwpose(tmp_path / name, size="tiny")
            assert all(torch.equal(v, net.state_dict()[k]) for k, v in sd.items()), name
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(net(x), want)), name


def _one_line_error(path, size="tiny") -> str:
    with pytest.raises(WeightsError) as e:
        load_dwpose(path, size=size)
    message = str(e.value)
    assert "\n" not in message and str(path) in message
    return message


def test_bad_files_are_one_line_errors_naming_the_file_and_the_tensor(tmp_path, tiny):
    sd = dict(tiny.state_dict())
    wrong = {**sd, "head.cls_x.weight": torch.zeros(5, 16)}
    _mmengine_checkpoint(tmp_path / "shape.pth", wrong)
    assert "head.cls_x.weight" in _one_line_error(tmp_path / "shape.pth")
    missing = {k: v for k, v in sd.items() if k != "head.gau.beta"}
    _mmengine_checkpoint(tmp_path / "missing.pth", missing)
    message = _one_line_error(tmp_path / "missing.pth")
    assert "missing" in message and "head.gau.beta" in message
    extra = {**{k: v.contiguous() for k, v in sd.items()}, "head.gau.w": torch.zeros(265)}
    save_file(extra, tmp_path / "extra.safetensors")
    assert "unexpected" in _one_line_error(tmp_path / "extra.safetensors")
    _mmengine_checkpoint(tmp_path / "tiny.pth", sd)
    assert "other shapes" in _one_line_error(tmp_path / "tiny.pth", size="full")  # a file of another size
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint at all" * 40)
    assert "cannot read" in _one_line_error(tmp_path / "junk.pth")
    torch.save({"meta": {}, "state_dict": {**sd, "head.note": "text"}}, tmp_path / "text.pth")
    assert "'head.note' is a str" in _one_line_error(tmp_path / "text.pth")


class Payload:
    """Unpickling this (anywhere) would create the file `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_code_in_a_checkpoint_never_runs(tmp_path, tiny):
    sd = tiny.state_dict()
    marker = tmp_path / "ran"
    _mmengine_checkpoint(tmp_path / "meta.pth", sd, message_hub=Payload(marker))
    net = load_dwpose(tmp_path / "meta.pth", size="tiny")  # what is not allowed is skipped outside the weights...
    assert torch.equal(net.state_dict()["head.gau.gamma"], sd["head.gau.gamma"])
    torch.save({"state_dict": {**sd, "head.cls_x.weight": Payload(marker)}}, tmp_path / "weights.pth",
               pickle_protocol=pickle.HIGHEST_PROTOCOL)
    assert "not a state dict of tensors" in _one_line_error(tmp_path / "weights.pth")  # ...and refused inside
    assert not marker.exists()


def test_simcc_decode_takes_the_first_maximum_the_smaller_score_and_marks_the_lost():
    sx = torch.zeros(1, 3, 576)
    sy = torch.zeros(1, 3, 768)
    sx[0, 0, 100], sy[0, 0, 300] = 2.0, 0.5  # found: (50, 150) px, score min(2, 0.5)
    sx[0, 1, [7, 9]], sy[0, 1, 11] = 1.0, 3.0  # a tie: the first bin
    sx[0, 2, 5], sy[0, 2, 6] = -1.0, 4.0  # every x logit <= 0... max is 0 -> lost
    points, scores = decode_simcc(sx, sy)
    assert points.tolist() == [[[50.0, 150.0], [3.5, 5.5], [-0.5, -0.5]]]
    assert scores.tolist() == [[0.5, 1.0, 0.0]]


def test_the_box_is_padded_to_three_by_four_and_the_crop_maps_back():
    boxes = torch.tensor([[0.0, 0.0, 640.0, 480.0], [100.0, 50.0, 160.0, 250.0]])
    center, scale = boxes_to_center_scale(boxes)
    assert center.tolist() == [[320.0, 240.0], [130.0, 150.0]]
    assert torch.allclose(scale, torch.tensor([[800.0, 800 / 0.75], [250 * 0.75, 250.0]]))
    # the input's centre pixel shows the box's centre, and its corners the padded box's corners
    corners = torch.tensor([[[144.0, 192.0], [0.0, 0.0], [288.0, 384.0]]]).expand(2, 3, 2)
    back = to_frame(corners, center, scale)
    assert torch.allclose(back[:, 0], center) and torch.allclose(back[:, 2] - back[:, 1], scale)


def test_the_crop_samples_the_frame_where_the_map_says():
    """A frame whose pixels hold their own coordinates: bilinear sampling reproduces them exactly."""
    h, w = 120, 160
    ys, xs = torch.meshgrid(torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32), indexing="ij")
    frame = torch.stack([xs, ys, xs + ys])[None]
    center, scale = boxes_to_center_scale(torch.tensor([[40.0, 20.0, 100.0, 90.0]]))
    x = crop(frame, center, scale) * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)
    v, u = torch.meshgrid(torch.arange(INPUT_HEIGHT, dtype=torch.float32),
                          torch.arange(INPUT_WIDTH, dtype=torch.float32), indexing="ij")
    where = to_frame(torch.stack([u, v], -1).view(1, -1, 2), center, scale).view(INPUT_HEIGHT, INPUT_WIDTH, 2)
    inside = (where[..., 0] >= 0) & (where[..., 0] <= w - 1) & (where[..., 1] >= 0) & (where[..., 1] <= h - 1)
    assert inside.float().mean() > 0.9
    assert torch.allclose(x[0, 0][inside], where[..., 0][inside], atol=1e-3)
    assert torch.allclose(x[0, 1][inside], where[..., 1][inside], atol=1e-3)


def test_the_crop_is_upstreams_cv2_warp_within_one_grey_level():
    """mmpose warps the uint8 frame with cv2.warpAffine (the matrix from its three points; no rotation)."""
    rng = np.random.default_rng(0)
    frame = cv2.GaussianBlur(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8), (0, 0), 3)
    box = torch.tensor([[60.0, 30.0, 250.0, 220.0]])
    center, scale = boxes_to_center_scale(box)
    c, s = center[0].numpy(), scale[0].numpy()
    src = np.float32([c, c + [0, -s[0] / 2], c + [-s[0] / 2, -s[0] / 2]])
    dst = np.float32([[144, 192], [144, 48], [0, 48]])
    want = cv2.warpAffine(frame, cv2.getAffineTransform(src, dst), (INPUT_WIDTH, INPUT_HEIGHT), flags=cv2.INTER_LINEAR)
    got = crop(torch.from_numpy(frame).permute(2, 0, 1)[None], center, scale)
    got = (got * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)).round()
    diff = (got[0].permute(1, 2, 0).numpy() - want.astype(np.float32))
    assert np.abs(diff).max() <= 1.0 and (diff != 0).mean() < 0.05


def test_flip_indices_swap_left_and_right_and_the_flip_test_is_mirror_symmetric(tiny):
    flip = torch.tensor(FLIP_INDICES)
    assert torch.equal(flip[flip], torch.arange(133))  # swapping twice is no swap
    assert all(FACE.start <= FLIP_INDICES[i] < FACE.stop for i in range(FACE.start, FACE.stop))
    assert FLIP_INDICES[0] == 0 and FLIP_INDICES[91] == 112 and FLIP_INDICES[23] == 39
    x = torch.randn(1, 3, INPUT_HEIGHT, INPUT_WIDTH)
    with torch.inference_mode():
        ax, ay = flip_test(tiny, x)
        bx, by = flip_test(tiny, x.flip(-1))
    # the mirrored crop's averaged logits are the crop's, keypoints swapped and x reversed
    assert torch.allclose(bx, ax[:, flip].flip(-1), atol=1e-5) and torch.allclose(by, ay[:, flip], atol=1e-5)


def test_face_points_of_a_batch_with_its_own_boxes(tiny):
    frames = torch.randint(0, 256, (3, 3, 120, 160), dtype=torch.uint8)
    boxes = torch.tensor([[10.0, 10.0, 90.0, 110.0], [0.0, 0.0, 160.0, 120.0], [50.0, 20.0, 150.0, 100.0]])
    with torch.inference_mode():
        points, scores = face_landmarks(tiny, frames, boxes)
        one = face_landmarks(tiny, frames[2:], boxes[2:])
        whole, _ = keypoints(tiny, frames[1:2])  # no box: the whole frame, as MuseTalk calls it
    assert points.shape == (3, 68, 2) and scores.shape == (3, 68)
    assert torch.allclose(points[2:], one[0], atol=1e-4) and torch.allclose(scores[2:], one[1], atol=1e-4)
    assert torch.allclose(points[1], whole[0, FACE], atol=1e-4)


# --- equality with the reference modules (mmdet 3.1.0 / mmpose 1.1.0) ---------------------------------------


def _reference(size: str, ours: torch.nn.Module) -> torch.nn.Module:
    pytest.importorskip("mmengine", reason="the reference modules need mmengine (see tests/dwpose_reference.py)")
    pytest.importorskip("mmcv.cnn", reason="the reference modules need mmcv or mmcv-lite 2.0.x")
    from dwpose_reference import reference_dwpose, reference_modules

    modules = reference_modules()
    if modules is None:
        pytest.skip("mmdet 3.1.0 / mmpose 1.1.0 files not found: set LIPSTREAM_DWPOSE_REFERENCE (dwpose_reference.py)")
    ref = reference_dwpose(modules, dwpose_config(size))
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ref


@pytest.mark.parametrize("size,batch", [("tiny", 3), ("full", 2)])
def test_the_network_equals_the_reference_modules(size, batch):
    ours = build_dwpose(size, device="cpu", seed=3)
    ref = _reference(size, ours)
    x = torch.randn(batch, 3, INPUT_HEIGHT, INPUT_WIDTH, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got, want = ours(x), ref(x)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
