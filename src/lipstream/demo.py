"""`make demo`: the built-in example, end to end for what exists today.

Speech (espeak-ng when installed, else a speech-like synthetic signal) -> decode -> Whisper
features -> per-frame windows, with untrained random weights (no download needed).
"""

from __future__ import annotations

import sys
from pathlib import Path

from lipstream.cli import main as cli_main
from lipstream.fixtures import espeak_speech


def main(out_dir: str = "demo-out") -> int:
    out = Path(out_dir)
    out.mkdir(exist_ok=True)
    speech, made_by = espeak_speech(out / "speech.wav")
    print(f"demo speech: {speech} ({made_by})")
    return cli_main(["features", str(speech), "--fps", "25", "--random-weights",
                     "-o", str(out / "speech-features.safetensors")])


if __name__ == "__main__":
    sys.exit(main())
