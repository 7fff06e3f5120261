"""What the show costs before its first frame (issue 29): the newsroom layers built and the music bed mixed.

    python benchmarks/show_prep.py [--device cpu] [--runs 3]
The show of benchmarks/show_cost.py (examples/newsroom's media) over 25.8 s of speech at 1920x1080:
`build_compositor` (sprites drawn, stills and the pip video opened, uploads) and `mix_music` (the bed
decoded, ducked, limited), each timed in this one process; the first run pays the imports and fonts a
one-shot render pays. render.prepare makes both on a thread beside the graph capture."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from show_cost import MEDIA, SHOW  # noqa: E402

from lipstream.fixtures import speech_like, write_audio  # noqa: E402
from lipstream.script import load_script  # noqa: E402
from lipstream.show.build import build_compositor  # noqa: E402
from lipstream.show.mix import mix_music  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in ("logo.png", "chart.png", "footage.mp4", "bed.m4a"):
            shutil.copy(MEDIA / name, work / name)
        write_audio(work / "speech.wav", speech_like(25.8, 16000, seed=1), 16000)
        (work / "show.yaml").write_text(SHOW)
        show = load_script(work / "show.yaml").show
        speech = np.full(48000 * 26, 0.01, np.float32)
        for run in range(args.runs):
            t = time.perf_counter()
            compositor = build_compositor(show, (1920, 1080), 30.0, [0.0], [25.8], "bt709", args.device)
            t1 = time.perf_counter()
            mix_music(speech, show.music, 48000)
            t2 = time.perf_counter()
            compositor.close()
            print(f"run {run}: layers {t1 - t:.3f} s, music {t2 - t1:.3f} s", flush=True)


if __name__ == "__main__":
    main()
