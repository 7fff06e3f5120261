"""`make demo`: the built-in example, end to end for what exists today.

1. An action loop of a real face photo (the fixture generator) is compiled into an avatar.
2. Speech (espeak-ng when installed, else a speech-like synthetic signal) becomes Whisper
   features and per-frame windows.
Both use untrained random weights (no download needed): tiny networks on a CPU, full-size ones
on a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lipstream.cli import main as cli_main
from lipstream.fixtures import espeak_speech
from lipstream.fixtures.avatar import action_loop


def main(out_dir: str = "demo-out") -> int:
    out = Path(out_dir)
    out.mkdir(exist_ok=True)
    size = "full" if torch.cuda.is_available() else "tiny"
    loop = out / "anchor.mp4"
    if not loop.exists():
        action_loop(loop, width=1280, height=720, seconds=4.0, fps=25)
    print(f"demo action loop: {loop} (generated from a photo)")
    code = cli_main(["compile", str(loop), "-o", str(out / "avatars"), "--random-weights", "--random-size", size])
    if code:
        return code
    speech, made_by = espeak_speech(out / "speech.wav")
    print(f"demo speech: {speech} ({made_by})")
    return cli_main(["features", str(speech), "--fps", "25", "--random-weights", "--random-size", size,
                     "-o", str(out / "speech-features.safetensors")])


if __name__ == "__main__":
    sys.exit(main())
