"""`render` with KeySync end to end on tiny random networks: the MP4's length, its sound, and every pixel
outside the generated region exactly the avatar's."""

from __future__ import annotations

import math

import av
import numpy as np
import pytest
import torch

from lipstream.avatar import load_avatar, ping_pong
from lipstream.engine.blend import untouched
from lipstream.engine.interface import FrameRequest
from lipstream.fixtures.avatar import tracked_avatar
from lipstream.fixtures.media import write_audio
from lipstream.fixtures.speech import speech_like
from lipstream.render.options import RenderOptions
from lipstream.render.script import single_scene

W, H, FPS = 320, 240, 10


@pytest.fixture(scope="module")
def keysync_models():
    from lipstream.keysync.load import random_keysync

    return random_keysync("tiny", "cpu")


@pytest.fixture(scope="module")
def anchor(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("keysync")
    folder = tracked_avatar(root, "kay", tiny_models.vae, tiny_models.fingerprints["vae"], width=W, height=H,
                            seconds=1.0, fps=FPS, seed=3)
    write_audio(root / "speech.wav", speech_like(2.0, 16000, seed=1), 16000)
    return folder, root / "speech.wav"


def test_a_keysync_render_has_every_frame_and_the_speech_and_repaints_only_the_mouth(anchor, keysync_models, tmp_path):
    from lipstream.keysync.avatar import crop_square
    from lipstream.keysync.render import render_keysync

    folder, speech = anchor
    out = tmp_path / "kay.mp4"
    report = render_keysync(single_scene(str(folder), speech, start_frame=2), out, keysync_models,
                            RenderOptions(crf=0, progress=False))  # crf 0: lossless, so pixels compare exactly
    with av.open(str(out)) as c:
        stream = c.streams.audio[0]
        audio_s = float(stream.duration * stream.time_base)
        frames = [f.to_ndarray() for f in c.decode(video=0)]
    assert len(frames) == report.frames == math.ceil(2.0 * FPS)  # all of them: KeySync's schedule padded, not cut
    assert abs(audio_s - 2.0) < 0.03
    avatar = load_avatar(folder)
    square = crop_square(avatar.landmarks.numpy(), W, H)
    keep = untouched(H, W, [list(square)])
    changed = 0
    for j, frame in enumerate(frames):
        source = avatar.frames[ping_pong(2 + j, avatar.num_frames)].numpy()
        assert np.array_equal(frame[keep], source[keep]), j
        x1, y1, x2, y2 = square
        upper = slice(y1, y1 + (y2 - y1) // 4)  # above the nose: outside KeySync's mask, kept
        assert np.array_equal(frame[upper, x1:x2], source[upper, x1:x2]), j
        changed += not np.array_equal(frame, source)
    assert changed == len(frames)  # every frame's mouth region generated
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kay.mp4"]


def test_keysync_refuses_crossfades_in_one_line(anchor, keysync_models, tmp_path):
    from lipstream.errors import LipStreamError
    from lipstream.keysync.render import render_keysync
    from lipstream.render.script import Program, Scene, Shot

    folder, speech = anchor
    program = single_scene(str(folder), speech)
    scene = program.scenes[0]
    crossfaded = Program([scene, Scene(audio=scene.audio, shots=scene.shots, crossfade=3)])
    with pytest.raises(LipStreamError, match="scene 2: KeySync scenes cut: a crossfade into or out of one"):
        render_keysync(crossfaded, tmp_path / "x.mp4", keysync_models, RenderOptions(progress=False))
    assert not list(tmp_path.iterdir())


def test_the_cli_renders_with_keysync_and_refuses_what_does_not_apply(anchor, tmp_path, capsys):
    from lipstream.cli import main

    folder, speech = anchor
    out = tmp_path / "cli.mp4"
    args = ["render", "--avatar", str(folder), "--audio", str(speech), "-o", str(out), "--device", "cpu"]
    assert main([*args, "--model", "keysync", "--random-weights"]) == 0
    printed = capsys.readouterr()
    assert "KeySync: tiny random networks" in printed.err and "[KeySync]" in printed.out
    with av.open(str(out)) as c:
        assert c.streams.video[0].frames == 20
    assert main([*args, "--model", "keysync", "--random-weights", "--keysync-preset", "draft"]) == 0  # fewer steps
    with av.open(str(out)) as c:
        assert c.streams.video[0].frames == 20
    for extra, message in ((["--model", "keysync", "--batch", "8"], "--batch applies to --model musetalk"),
                           (["--model", "keysync", "--keysync-preset", "turbo"], "--keysync-preset 'turbo'"),
                           (["--model", "kesync"], "--model 'kesync': expected one of musetalk, keysync"),
                           (["--model", "keysync", "--models", str(tmp_path)], "KeySync's weights are not in")):
        assert main([*args, *extra]) != 0
        assert message in capsys.readouterr().err


def test_a_script_mixes_models_scene_by_scene(anchor, keysync_models, tiny_models, tmp_path):
    """musetalk, then keysync, then musetalk again (cuts): one MP4, each scene's frames repainted by its own
    model, everything outside that model's region exactly the avatar's."""
    from lipstream.keysync.avatar import crop_square
    from lipstream.keysync.render import render_keysync
    from lipstream.render.script import load_script

    folder, speech = anchor
    script = tmp_path / "show.yaml"
    script.write_text(f"avatars: {folder.parent}\nscenes:\n"
                      f"  - {{avatar: kay, audio: {speech}}}\n"
                      f"  - {{avatar: kay, audio: {speech}, model: keysync, start_frame: 4}}\n"
                      f"  - {{avatar: kay, audio: {speech}, model: musetalk}}\n")
    program = load_script(script)
    assert [s.model for s in program.scenes] == [None, "keysync", "musetalk"]
    out = tmp_path / "mixed.mp4"
    report = render_keysync(program, out, keysync_models, RenderOptions(crf=0, progress=False), default="musetalk",
                            musetalk=tiny_models)
    with av.open(str(out)) as c:
        frames = [f.to_ndarray() for f in c.decode(video=0)]
    assert len(frames) == report.frames == 3 * 20
    avatar = load_avatar(folder)
    square = list(crop_square(avatar.landmarks.numpy(), W, H))
    for j, frame in enumerate(frames):
        scene, local = divmod(j, 20)
        k = ping_pong(local + (4 if scene == 1 else 0), avatar.num_frames)
        source = avatar.frames[k].numpy()
        region = square if scene == 1 else avatar.boxes[k].tolist()
        keep = untouched(H, W, [region])
        assert np.array_equal(frame[keep], source[keep]), j
        assert not np.array_equal(frame, source), j


def test_a_scene_names_only_a_model_there_is(tmp_path):
    from lipstream.errors import InputError
    from lipstream.render.script import load_script

    script = tmp_path / "show.yaml"
    script.write_text("scenes:\n  - {avatar: kay, audio: a.wav, model: keysnc}\n")
    (tmp_path / "a.wav").write_bytes(b"")
    with pytest.raises(InputError, match="scene 1: model must be one of musetalk, keysync"):
        load_script(script)


def test_compile_keysync_prepares_the_latents_a_render_reads(anchor, keysync_models, tmp_path, capsys):
    """`compile --keysync` writes keysync.safetensors (every loop frame's latents and mask in the square); a
    render reads it where the encoder and the square match, and makes them again where they do not."""
    import shutil

    from safetensors import safe_open

    from lipstream.cli import main
    from lipstream.keysync.avatar import PREPARED, encoder_fingerprint, read_prepared
    from lipstream.keysync.engine import KeySyncEngine

    folder, speech = anchor
    loop = tmp_path / "kay.mp4"
    shutil.copy(folder.parent.parent / "kay.mp4", loop)
    track = folder.parent.parent / "kay.track.json"
    assert main(["compile", str(loop), "-o", str(tmp_path / "avatars"), "--track", str(track), "--random-weights",
                 "--random-size", "tiny", "--device", "cpu", "--keysync"]) == 0
    assert "KeySync's latents and masks in keysync.safetensors" in capsys.readouterr().out
    prepared = tmp_path / "avatars" / "kay" / PREPARED
    avatar = load_avatar(prepared.parent)
    with safe_open(str(prepared), "pt") as f:
        assert f.get_tensor("latents").shape == (avatar.num_frames, 4, 16, 16)
        assert f.get_tensor("masks").shape == (avatar.num_frames, 16, 16)
        assert f.metadata()["encoder"] == encoder_fingerprint(keysync_models.networks.vae)
    engine = KeySyncEngine(keysync_models)
    engine.add_avatar(avatar)
    assert engine._prepared[0] is not None  # the render reads them
    made = engine._inputs([FrameRequest(0, f, torch.zeros(4, 64)) for f in range(avatar.num_frames)])
    engine._prepared[0] = None
    again = engine._inputs([FrameRequest(0, f, torch.zeros(4, 64)) for f in range(avatar.num_frames)])
    torch.testing.assert_close(made.latents, again.latents, rtol=1e-4, atol=1e-5)
    assert torch.equal(made.masks, again.masks)
    from lipstream.keysync.load import random_keysync

    other = random_keysync("tiny", "cpu", seed=9)  # another encoder: not its latents
    assert read_prepared(avatar, other.networks.vae, 128, torch.device("cpu")) is None


def test_the_shows_layers_paint_over_keysyncs_frames(anchor, keysync_models, tmp_path):
    from PIL import Image

    from lipstream.keysync.render import render_keysync
    from lipstream.render.script import load_script

    folder, speech = anchor
    Image.new("RGBA", (64, 32), (0, 255, 0, 255)).save(tmp_path / "logo.png")
    script = tmp_path / "show.yaml"
    script.write_text(f"avatars: {folder.parent}\nscenes:\n  - {{avatar: kay, audio: {speech}}}\n"
                      "overlays:\n  logo: {image: logo.png, corner: top-right, margin: 16}\n")
    out = tmp_path / "show.mp4"
    render_keysync(load_script(script), out, keysync_models, RenderOptions(crf=0, progress=False))
    with av.open(str(out)) as c:
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(frames) == 20
    for k in (5, len(frames) - 2):  # the logo after its fade in, over KeySync's frames
        assert np.abs(frames[k][16 + 16, W - 16 - 32].astype(int) - [0, 255, 0]).max() < 40, k


def test_a_keysync_render_stops_between_unet_calls_and_leaves_nothing(anchor, keysync_models, tmp_path):
    """check() runs between UNet calls (a chunk takes minutes on a GPU): what it raises stops the render there,
    before any frame is written, and no output is left."""
    from lipstream.keysync.render import render_keysync

    class Stop(Exception):
        pass

    calls = []

    def check():
        calls.append(1)
        if len(calls) == 2:
            raise Stop

    folder, speech = anchor
    with pytest.raises(Stop):
        render_keysync(single_scene(str(folder), speech), tmp_path / "x.mp4", keysync_models,
                       RenderOptions(progress=False), check=check)
    assert len(calls) == 2 and not list(tmp_path.iterdir())
