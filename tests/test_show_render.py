"""The newsroom show through the whole render: a script with every layer, a text scene and a music bed,
rendered to an MP4 (lossless, so pixels compare exactly), decoded and checked against the same program
rendered without its show."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from lipstream.fixtures import speech_like, write_audio
from lipstream.render.options import RenderOptions
from lipstream.render.program import render_program
from lipstream.render.script import load_script
from lipstream.show.spec import SceneLayers, Show

pytestmark = [pytest.mark.slow,  # whole shows rendered: `make test` only
              pytest.mark.skipif(shutil.which("espeak-ng") is None,
                                 reason="espeak-ng is not installed (make espeak installs Debian's package)")]

PIP = (360, 80, 540, 200)  # clear of the logo (top right) and the lower third (bottom left)


def _rgb(path: Path) -> tuple[list[np.ndarray], float, np.ndarray]:
    with av.open(str(path)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    with av.open(str(path)) as c:
        audio = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])
        rate = c.streams.audio[0].rate
    return frames, rate, audio


@pytest.fixture(scope="module")
def show_script(tmp_path_factory, presenter):
    root = tmp_path_factory.mktemp("show")
    write_audio(root / "story.wav", speech_like(1.6, 16000, seed=3), 16000)
    t = np.arange(48000 * 3) / 48000
    write_audio(root / "bed.wav", (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 48000)
    Image.new("RGBA", (120, 60), (255, 0, 0, 255)).save(root / "red.png")
    Image.new("RGB", (320, 180), (0, 0, 255)).save(root / "blue.png")
    Image.new("RGBA", (64, 32), (0, 255, 0, 255)).save(root / "logo.png")
    (root / "show.yaml").write_text(f"""
avatars: {presenter.parent}
scenes:
  - avatar: p
    audio: story.wav
    lower_third: {{title: "Anna Berg", subtitle: "Berlin", from: 0.2, to: 1.4}}
    pip: {{source: red.png, box: [{", ".join(map(str, PIP))}], from: 0.3, to: 1.2}}
  - avatar: p
    text: "Markets closed higher today."
    cutaway: {{source: blue.png, from: 0.4, to: 1.4}}
overlays:
  logo: {{image: logo.png, corner: top-right, margin: 16}}
  ticker: {{text: "Breaking: LipStream composes the show in the render's own pass", speed: 120}}
music: {{file: bed.wav, gain_db: -18, duck_db: -12}}
""")
    return root / "show.yaml"


@pytest.fixture(scope="module")
def rendered(show_script, tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    program = load_script(show_script)
    options = RenderOptions(crf=0, progress=False)
    shown = render_program(program, out / "show.mp4", tiny_models, options)
    bare = dataclasses.replace(program, show=Show(scenes=[SceneLayers() for _ in program.scenes]))
    plain = render_program(bare, out / "bare.mp4", tiny_models, options)
    return _rgb(out / "show.mp4"), _rgb(out / "bare.mp4"), list(out.iterdir()), (shown, plain)


def test_the_render_loop_accounts_for_the_shows_layers(rendered):
    """--timings says what the layers cost the producer and how long it waited on video decoders (none
    here: stills); a render without a show has no such rows."""
    shown, plain = rendered[3]
    assert 0 < shown.timings["produce_show_s"] <= shown.timings["produce_launch_s"]
    assert shown.timings["show_decoder_wait_s"] == 0
    assert "produce_show_s" not in plain.timings and "show_decoder_wait_s" not in plain.timings


def test_the_show_renders_every_layer_where_and_when_the_script_says(rendered):
    (frames, _, _), (bare, _, _), files, _ = rendered
    assert len(frames) == len(bare) and sorted(f.name for f in files) == ["bare.mp4", "show.mp4"]
    n1 = 16  # frames of scene 1: 1.6 s at the avatar's 10 fps
    x1, y1, x2, y2 = PIP
    cx, cy = (x1 + x2) // 2, (y1 + y2) // 2
    # the pip: red at its box's centre well inside its span, the presenter's own pixels before it
    assert np.abs(frames[8][cy, cx].astype(int) - [255, 0, 0]).max() < 40
    assert np.array_equal(frames[1][y1:y2, x1:x2], bare[1][y1:y2, x1:x2])
    # the cutaway: the whole frame blue in scene 2 at 0.8 s (the ticker and logo paint over it)
    mid = frames[n1 + 8][60:250, 40:560].astype(int)
    assert np.abs(mid - [0, 0, 255]).max() < 40
    assert not np.array_equal(frames[n1 + 2][60:250, 40:560], mid)  # before its span: the presenter
    # the logo: green at the top-right corner, 16 px in, on every frame after its fade in
    for k in (5, len(frames) - 8):
        assert np.abs(frames[k][16 + 16, 640 - 16 - 32].astype(int) - [0, 255, 0]).max() < 40
    # the ticker: a band at the bottom that differs from the bare render, its text moving
    assert not np.array_equal(frames[10][-20:], bare[10][-20:])
    assert not np.array_equal(frames[10][-20:], frames[11][-20:])
    # outside every layer the frames are the bare render's, to the bit (lossless encode)
    for k in range(len(frames)):
        in_cutaway = n1 + 4 <= k < n1 + 15
        if not in_cutaway:
            assert np.array_equal(frames[k][60:200, 150:340], bare[k][60:200, 150:340]), k


def test_the_text_scene_is_spoken_and_the_bed_lies_under_the_speech(rendered):
    (frames, rate, audio), (_, _, bare_audio), _, _ = rendered
    assert abs(len(audio) - len(bare_audio)) <= rate // 50
    seconds = len(audio) / rate
    assert 1.6 + 1.0 < seconds < 1.6 + 5.0  # 1.6 s of speech, then "Markets closed higher today."
    assert np.abs(audio).max() <= 1.0
    n = min(len(audio), len(bare_audio))
    bed = audio[:n] - bare_audio[:n]
    assert np.sqrt(np.mean(bed ** 2)) > 1e-3  # the music is in the mix
    assert len(frames) == round(seconds * 10) or abs(len(frames) - seconds * 10) <= 1


def test_a_server_job_paints_the_show_over_the_live_engines_host_frames(show_script, tmp_path):
    """A server's job: its frames come back from the live engine on the host, the show's layers live on
    the networks' device (the GPU's on a GPU server, where the H200's suite runs this): the render moves
    each batch over and paints it there; the logo shows."""
    import torch

    from lipstream.live.engine import LiveEngine
    from lipstream.live.offline import OfflineLane
    from lipstream.models import load_musetalk

    device = "cuda" if torch.cuda.is_available() else "cpu"
    models = load_musetalk(random_weights=True, size="tiny", device=device, seed=0)
    program = load_script(show_script)
    live = LiveEngine(models, "realtime" if device == "cuda" else "cpu")
    live.add_avatar(program.avatars_dir / "p")
    with live:
        render_program(program, tmp_path / "job.mp4", models, RenderOptions(crf=0, progress=False),
                       engine=OfflineLane(live))
    frames, _, _ = _rgb(tmp_path / "job.mp4")
    assert np.abs(frames[5][16 + 16, 640 - 16 - 32].astype(int) - [0, 255, 0]).max() < 40
