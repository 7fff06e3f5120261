"""`make demo`: the built-in example, end to end.

1. An action loop of a real face photo (the fixture generator) is compiled into an avatar, its face from the
   photo's own landmarks moved with the loop (a track file: no face tracker, no download).
2. Speech: espeak-ng when installed, else a speech-like synthetic signal.
3. The avatar speaks it: an H.264/AAC MP4, rendered with untrained random weights (no download
   needed), so the mouth region is noise, not speech. Tiny networks on a CPU, full-size on a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from lipstream.cli import main as cli_main
from lipstream.fixtures import espeak_speech
from lipstream.fixtures.avatar import action_loop, write_track


def main(out_dir: str = "demo-out") -> int:
    out = Path(out_dir)
    out.mkdir(exist_ok=True)
    gpu = torch.cuda.is_available()
    size = "full" if gpu else "tiny"
    width, height = (1920, 1080) if gpu else (640, 360)
    loop, track = out / f"anchor-{height}p.mp4", out / f"anchor-{height}p.track.json"
    if not (loop.exists() and track.exists()):
        write_track(action_loop(loop, width=width, height=height, seconds=4.0, fps=25), track)
    print(f"1. action loop: {loop} (generated from a photo); its face: {track.name}, the photo's landmarks moved "
          "with the loop (no face tracker needed: real ones are DWPose after `lipstream weights download`, or dlib)")
    common = ["--random-weights", "--random-size", size]
    code = cli_main(["compile", str(loop), "-o", str(out / "avatars"), "--track", str(track), *common])
    if code:
        return code
    speech, made_by = espeak_speech(out / "speech.wav")
    print(f"2. speech: {speech} ({made_by})")
    video = out / "demo.mp4"
    code = cli_main(["render", "--avatar", loop.stem, "--avatars", str(out / "avatars"), "--audio", str(speech),
                     "-o", str(video), *common])
    if code == 0:
        print(f"3. output: {video.resolve()}")
        print("   The weights are random (no MuseTalk download here), so the mouth is noise, not speech: use "
              "`lipstream weights download` and drop --random-weights for a real lip-sync.")
    return code


SHOW = Path(__file__).resolve().parents[2] / "examples" / "newsroom" / "show.yaml"


def show(out_dir: str = "demo-out") -> int:
    """`make show`: the example newsroom show (examples/newsroom/show.yaml) at 1080p, with a presenter
    generated here (random weights, as above): titles, picture-in-picture, a cutaway, logo, ticker, a text
    scene spoken by espeak-ng and a music bed under the speech, in one render."""
    out = Path(out_dir) / "newsroom"
    out.mkdir(parents=True, exist_ok=True)
    size = "full" if torch.cuda.is_available() else "tiny"
    loop = out / "anchor.mp4"  # the avatar's name in the script is its file's stem
    track = out / "anchor.track.json"
    if not (loop.exists() and track.exists()):
        write_track(action_loop(loop, width=1920, height=1080, seconds=4.0, fps=25), track)
    common = ["--random-weights", "--random-size", size]
    code = cli_main(["compile", str(loop), "-o", str(out / "avatars"), "--track", str(track), *common])
    if code:
        return code
    video = Path(out_dir) / "newsroom.mp4"
    code = cli_main(["broadcast", str(SHOW), "--avatars", str(out / "avatars"), "-o", str(video), *common])
    if code == 0:
        print(f"the show: {video.resolve()} (random weights: the mouth is noise, the show around it is real)")
    return code


if __name__ == "__main__":
    sys.exit(show() if sys.argv[1:] == ["--show"] else main())
