"""Load a compiled avatar in a fresh process: `python benchmarks/avatar_load.py AVATAR_DIR`.

CUDA is initialised first (a process cost, not an avatar cost); then the avatar is loaded
resident on the GPU and the time printed as JSON.
"""

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from lipstream.avatar import load_avatar  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
t = time.perf_counter()
if device == "cuda":
    torch.zeros(1, device=device)
    torch.cuda.synchronize()
init = time.perf_counter() - t
t = time.perf_counter()
avatar = load_avatar(sys.argv[1], device)
print(json.dumps({"cuda_init_s": init, "load_s": time.perf_counter() - t, **avatar.timings,
                  "frames": avatar.num_frames, "frames_bytes_on_device": avatar.frames.numel()}))
