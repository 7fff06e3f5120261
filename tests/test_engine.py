"""Engine pieces: batched blending equals the per-frame blend; nothing outside a box changes."""

from __future__ import annotations

import pytest
import torch

from lipstream.engine.blend import blend_batch, blend_into, untouched

H, W = 360, 640
BOXES = [[101, 51, 300, 290], [100, 50, 401, 301], [0, 0, 211, 199], [430, 161, 640, 360], [333, 77, 501, 251],
         [5, 3, 130, 160], [2, 2, 640, 360]]


@pytest.mark.parametrize("matrix", ["bt601", "bt709"])
def test_batched_blend_equals_per_frame_blend(matrix):
    g = torch.Generator().manual_seed(1)
    n = len(BOXES)
    frames = torch.randint(0, 256, (n, H * 3 // 2, W), dtype=torch.uint8, generator=g)
    faces = torch.rand(n, 3, 256, 256, generator=g)
    masks = torch.randint(0, 256, (n, 256, 256), dtype=torch.uint8, generator=g)
    masks[:, [0, -1]] = 0
    masks[:, :, [0, -1]] = 0
    one, batch = frames.clone(), frames.clone()
    for i in range(n):
        blend_into(one[i], faces[i], masks[i], BOXES[i], H, W, matrix)
    blend_batch(batch, faces, masks, BOXES, H, W, matrix)
    assert (one.int() - batch.int()).abs().max() <= 1
    assert (one != batch).float().mean() < 1e-3  # float rounding only
    for i, box in enumerate(BOXES):
        keep = torch.from_numpy(untouched(H, W, [box]))
        assert torch.equal(batch[i][keep], frames[i][keep])
        assert not torch.equal(batch[i], frames[i])
