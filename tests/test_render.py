"""Renderer: real avatars and audio in, MP4 out, decoded and checked frame by frame."""

from __future__ import annotations

import functools
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from lipstream.render import loop as render_loop
from lipstream.avatar import load_avatar, ping_pong
from lipstream.engine.blend import untouched
from lipstream.errors import InputError
from lipstream.fixtures import speech_like, write_audio
from lipstream.fixtures.avatar import tracked_avatar
from lipstream.engine import ModuleEngine
from lipstream.media.mp4 import MP4Writer
from lipstream.models import load_musetalk
from lipstream.engine.options import ENGINE_PRESETS, EngineOptions
from lipstream.render.options import RenderOptions
from lipstream.render.program import prepare, render_program, write
from lipstream.render.script import load_script, single_scene

W, H, FPS = 640, 360, 10


@pytest.fixture(scope="module")
def studio(tmp_path_factory, tiny_models):
    """Three compiled presenters (different motion; landmarks from the known motion, no face detector)
    and some speech files."""
    root = tmp_path_factory.mktemp("studio")
    for i, name in enumerate(("anna", "ben", "cleo")):
        tracked_avatar(root, name, tiny_models.vae, tiny_models.fingerprints["vae"], width=W, height=H,
                       seconds=1.0, fps=FPS, motion=1.5 + i, seed=10 + i)
    for name, seconds in (("a", 0.8), ("b", 1.1), ("c", 0.7), ("long", 2.0)):
        write_audio(root / f"{name}.wav", speech_like(seconds, 16000, seed=len(name)), 16000)
    return root


def decode(path: Path) -> tuple[list[np.ndarray], dict]:
    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        info = {"fps": v.average_rate, "audio_s": float(a.duration * a.time_base), "colorspace": v.codec_context.colorspace}
        frames = []
        for f in c.decode(v):
            if not frames:
                info["video_start"] = float(f.time)
            frames.append(f.to_ndarray())
    with av.open(str(path)) as c:
        first = next(c.decode(audio=0))
        info["audio_start"] = float(first.time)
    return frames, info


def outside_box(frame: np.ndarray, boxes: list) -> np.ndarray:
    return untouched(H, W, boxes)


@pytest.mark.parametrize("encoders, processes", [(1, False), pytest.param(3, False, marks=pytest.mark.slow), (2, True)],
                         ids=["one-encoder", "3-segment-threads", "2-segment-processes"])
def test_render_frames_audio_and_untouched_pixels(studio, tiny_models, tmp_path, encoders, processes):
    out = tmp_path / "talk.mp4"
    options = RenderOptions(avatars_dir=studio / "avatars", crf=0, encoders=encoders, progress=False)
    if processes:  # MP4Writer's segment encoders as processes (no flag of the CLI's: render.loop.write's own writer)
        options = options.for_machine("cpu", 2)
        plan = prepare(single_scene("anna", studio / "long.wav", start_frame=3), tiny_models, ModuleEngine(tiny_models),
                       options)
        report = write(plan, out, options, writer=functools.partial(MP4Writer, processes=True))
    else:
        report = render_program(single_scene("anna", studio / "long.wav", start_frame=3), out, tiny_models, options)
    frames, info = decode(out)
    assert len(frames) == report.frames == math.ceil(2.0 * FPS)
    assert abs(len(frames) - round(2.0 * FPS)) <= 1
    assert info["fps"] == FPS and abs(info["audio_s"] - 2.0) < 0.03
    assert info["video_start"] == 0 and abs(info["audio_start"]) < 1e-3
    avatar = load_avatar(studio / "avatars" / "anna")
    for j, frame in enumerate(frames):
        k = ping_pong(3 + j, avatar.num_frames)
        source = avatar.frames[k].numpy()
        keep = outside_box(frame, [avatar.boxes[k].tolist()])
        assert np.array_equal(frame[keep], source[keep]), j
        assert not np.array_equal(frame, source)  # the mouth region was repainted
    assert sorted(p.name for p in tmp_path.iterdir()) == ["talk.mp4"]
    data = out.read_bytes()
    assert data.find(b"moov") < data.find(b"mdat")  # +faststart: the index comes first


@pytest.mark.slow
def test_loops_at_another_fps_step_by_time(studio, tiny_models, tmp_path):
    from fractions import Fraction

    out = tmp_path / "fps20.mp4"
    render_program(single_scene("cleo", studio / "a.wav"), out, tiny_models,
                   RenderOptions(avatars_dir=studio / "avatars", fps=Fraction(20), crf=0, progress=False))
    frames, info = decode(out)
    assert info["fps"] == 20 and len(frames) == 16
    avatars = {"cleo": load_avatar(studio / "avatars" / "cleo")}
    a = avatars["cleo"]
    for j, frame in enumerate(frames):  # output frame j shows loop step floor(j / 20 * 10)
        k = ping_pong(j // 2, a.num_frames)
        keep = outside_box(frame, [a.boxes[k].tolist()])
        assert np.array_equal(frame[keep], a.frames[k].numpy()[keep]), j


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * math.log10(255 ** 2 / mse)


def test_the_render_loop_runs_at_a_short_gil_switch_interval_and_gives_it_back(studio, tiny_models, tmp_path):
    """The producer's ops each take the GIL back from the writer's threads: the loop shortens the interval
    CPython makes them wait (render_loop.LOOP_SWITCH_INTERVAL_S), and the process gets its own back after."""
    before = sys.getswitchinterval()
    seen: list[float] = []
    render_program(single_scene("ben", studio / "b.wav"), tmp_path / "o.mp4", tiny_models,
                   RenderOptions(avatars_dir=studio / "avatars", progress=False),
                   on_progress=lambda done, total: seen.append(sys.getswitchinterval()))
    assert seen and max(seen) <= render_loop.LOOP_SWITCH_INTERVAL_S < before
    assert sys.getswitchinterval() == before


def test_fast_path_matches_reference(studio, tiny_models, tmp_path):
    fast, ref = tmp_path / "fast.mp4", tmp_path / "ref.mp4"
    program = single_scene("ben", studio / "b.wav")
    render_program(program, fast, tiny_models, RenderOptions(avatars_dir=studio / "avatars", crf=0, progress=False))
    render_program(program, ref, tiny_models, RenderOptions(ENGINE_PRESETS["reference"], avatars_dir=studio / "avatars",
                                                            crf=0, progress=False))
    (fa, _), (fb, _) = decode(fast), decode(ref)
    avatar = load_avatar(studio / "avatars" / "ben")
    assert len(fa) == len(fb) == math.ceil(1.1 * FPS)
    values = []
    for j, (x, y) in enumerate(zip(fa, fb)):
        x1, y1, x2, y2 = avatar.boxes[ping_pong(j, avatar.num_frames)].tolist()
        values.append(psnr(x[y1:y2, x1:x2], y[y1:y2, x1:x2]))
    assert min(values) >= 40, values


def tiny_models_on(device: str):
    """conftest's tiny networks, drawn on the CPU as the studio's avatars were compiled with (a GPU's draw
    differs, and the avatars would refuse its VAE), on `device` in its dtype."""
    from lipstream.models.load import default_dtype

    models = load_musetalk(random_weights=True, size="tiny", device="cpu", seed=0)
    if device != "cpu":
        dev = torch.device(device)
        models.device, models.dtype = dev, default_dtype(dev)
        for name in ("unet", "vae", "whisper"):
            setattr(models, name, getattr(models, name).to(device=dev, dtype=models.dtype))
        models.pe = models.pe.to(dev)
    return models


@pytest.fixture
def graph_device(request):
    """cuda where there is one (real graphs: the H200's suite run), else the CPU with graphs played by a stand-in."""
    if torch.cuda.is_available():
        return "cuda"
    request.getfixturevalue("replay_graphs")
    return "cpu"


@pytest.mark.slow
def test_the_first_batch_renders_before_the_other_buckets_are_captured(studio, tmp_path, graph_device, monkeypatch):
    """A one-shot render captures the first batch's bucket before the first frame and the others while
    that batch encodes: the same frames as an engine with every bucket captured first, each bucket once."""
    monkeypatch.setattr(render_loop, "EARLY_BATCHES", 2)  # the capture in the loop comes by the second batch
    monkeypatch.setattr(render_loop, "LATER_CAPTURE_COST_S", 0.0)  # however few frames are left
    models, program, options, lazy, eager = graph_render(studio, graph_device)
    first = render_program(program, tmp_path / "lazy.mp4", models, options, engine=lazy)
    eager.add_avatar(lazy.avatars[0])
    assert set(eager.warm_up()) == {f"{kind} {b}" for kind in ("step", "blend") for b in eager.buckets}
    assert eager.warm_up() == {}  # captured already: nothing again
    render_program(program, tmp_path / "eager.mp4", models, options, engine=eager)
    assert set(lazy._net) == set(eager._net) and len(lazy.buckets) == 2
    small, large = lazy.buckets  # the first batch's, before the first frame; the other, in the render loop
    steps = sorted(k for k in first.timings if k.startswith("warmup") and "step" in k)
    assert steps == [f"warmup later step {large} s", f"warmup step {small} s"], first.timings
    assert first.timings["warmup_later_s"] > 0
    (a, _), (b, _) = decode(tmp_path / "lazy.mp4"), decode(tmp_path / "eager.mp4")
    assert len(a) == len(b) == math.ceil(2.0 * FPS)
    diff = max(np.abs(x.astype(int) - y.astype(int)).max() for x, y in zip(a, b))
    assert diff == 0 if graph_device == "cpu" else diff <= 1  # CUDA: the same kernels, in a graph or not


def graph_render(studio, graph_device, **render_options):
    """The long speech, the tiny networks on `graph_device`, lossless options with graphs, and two engines on
    them: one to render lazily (as a one-shot render captures), one to capture everything first."""
    models = tiny_models_on(graph_device)
    # a first bucket of 8 on any device (a GPU's default is 16): the 20 frames make three batches
    options = RenderOptions(ENGINE_PRESETS["fast"].replace(graphs=True, first_batch=8), avatars_dir=studio / "avatars",
                            crf=0, progress=False, **render_options)
    engine_options = options.for_machine(graph_device, 2).engine
    return (models, single_scene("ben", studio / "long.wav"), options, ModuleEngine(models, engine_options),
            ModuleEngine(models, engine_options))


def same_frames_as_every_bucket_captured(lazy, eager, models, program, options, tmp_path, graph_device) -> None:
    """`eager`, every bucket captured before its render, gives lazy.mp4's frames (lossless: to the bit on the
    CPU stand-in, within 1 on CUDA, the same kernels in a graph or not)."""
    eager.add_avatar(lazy.avatars[0])
    eager.warm_up()
    render_program(program, tmp_path / "eager.mp4", models, options, engine=eager)
    (a, _), (b, _) = decode(tmp_path / "lazy.mp4"), decode(tmp_path / "eager.mp4")
    assert len(a) == len(b) == math.ceil(2.0 * FPS)
    diff = max(np.abs(x.astype(int) - y.astype(int)).max() for x, y in zip(a, b))
    assert diff == 0 if graph_device == "cpu" else diff <= 1


@pytest.mark.slow
def test_the_other_buckets_are_captured_once_the_first_packet_is_out(studio, tmp_path, graph_device, monkeypatch):
    """The capture in the render loop holds the GIL the first segment's reply and mux need: it waits for the
    first packet (first-bucket batches meanwhile), unless EARLY_BATCHES of them went first; the frames are
    those of an engine with every bucket captured before."""
    monkeypatch.setattr(render_loop, "LATER_CAPTURE_COST_S", 0.0)
    # the decision by the 2nd of the 3 batches: a GPU renders them all before the first packet is out
    monkeypatch.setattr(render_loop, "EARLY_BATCHES", 2)
    models, program, options, lazy, eager = graph_render(studio, graph_device, encoders=2, encoder_processes=True)
    report = render_program(program, tmp_path / "lazy.mp4", models, options, engine=lazy)
    t = report.timings
    assert 1 <= t["early_batches"] <= render_loop.EARLY_BATCHES, t
    assert t["early_batches"] == render_loop.EARLY_BATCHES or report.first_frame_s <= t["warmup_later_at_s"], t
    same_frames_as_every_bucket_captured(lazy, eager, models, program, options, tmp_path, graph_device)


@pytest.mark.slow
def test_a_short_render_never_captures_the_other_buckets(studio, tmp_path, graph_device, monkeypatch):
    """Too few frames left for the full bucket to repay its capture at the first bucket's measured rate: the
    first renders them all, the same frames as every bucket captured."""
    monkeypatch.setattr(render_loop, "EARLY_BATCHES", 2)  # decided by the 2nd batch, the first packet out or not
    models, program, options, lazy, eager = graph_render(studio, graph_device)
    report = render_program(program, tmp_path / "lazy.mp4", models, options, engine=lazy)
    small, large = lazy.buckets
    assert {b for b, _ in lazy._net} == {small}  # the first bucket's graph only
    frames = math.ceil(2.0 * FPS)
    t = report.timings
    assert 0 < t["warmup_later_skipped_frames"] < frames and "warmup_later_s" not in t
    assert not render_loop.later_capture_pays(t["warmup_later_skipped_frames"], t["first_bucket_fps"])
    same_frames_as_every_bucket_captured(lazy, eager, models, program, options, tmp_path, graph_device)


def test_the_later_capture_pays_for_long_or_slow_renders_only():
    assert not render_loop.later_capture_pays(775, 412.0)  # the monologue on the H200's packages: 0.63 s to save
    assert render_loop.later_capture_pays(775, 250.0)  # a slower first bucket (the uncompiled modules'): 1.03 s
    assert render_loop.later_capture_pays(18_000, 412.0)  # ten minutes of video
    assert render_loop.later_capture_pays(10, None)  # no rate measured yet: as before, capture


def test_the_first_bucket_is_16_on_a_gpu_and_8_on_a_cpu_unless_asked():
    assert EngineOptions().for_device("cuda").buckets == (16, 32)
    assert EngineOptions().for_device("cpu").buckets == (8, 16)
    assert EngineOptions(first_batch=8).for_device("cuda").buckets == (8, 32)
    assert EngineOptions(batch=12, first_batch=32).for_device("cuda").buckets == (12,)
    with pytest.raises(ValueError, match="first_batch 0"):
        EngineOptions(first_batch=0).check()


@pytest.mark.slow
def test_capture_later_runs_the_first_batch_uncaptured(studio, tmp_path, graph_device, monkeypatch):
    """EngineOptions.capture "later": nothing is captured before the first frame, the first batch runs
    uncaptured and every bucket is captured in the render loop; the frames are the default capture's."""
    monkeypatch.setattr(render_loop, "LATER_CAPTURE_COST_S", 0.0)  # "before" captures its other bucket too
    monkeypatch.setattr(render_loop, "EARLY_BATCHES", 2)  # by the 2nd batch (a GPU outruns the first packet)
    models = tiny_models_on(graph_device)
    program = single_scene("ben", studio / "long.wav")
    frames = {}
    for capture in ("before", "later"):
        options = RenderOptions(ENGINE_PRESETS["fast"].replace(graphs=True, capture=capture, first_batch=8),
                                avatars_dir=studio / "avatars", crf=0, progress=False)
        engine = ModuleEngine(models, options.for_machine(graph_device, 2).engine)
        report = render_program(program, tmp_path / f"{capture}.mp4", models, options, engine=engine)
        frames[capture] = decode(tmp_path / f"{capture}.mp4")[0]
        assert len(engine._net) == len(engine.buckets) == 2  # every bucket captured once, either way
    steps = {k for k in report.timings if k.startswith("warmup") and "step" in k}
    assert steps == {f"warmup later step {b} s" for b in engine.buckets}, report.timings
    assert report.timings["warmup_s"] < report.timings["warmup_later_s"]  # nothing captured before the frames
    assert len(frames["later"]) == len(frames["before"]) == math.ceil(2.0 * FPS)
    diff = max(np.abs(x.astype(int) - y.astype(int)).max() for x, y in zip(frames["before"], frames["later"]))
    assert diff == 0 if graph_device == "cpu" else diff <= 1  # the same kernels, in a graph or not
    with pytest.raises(ValueError, match="capture 'soon'"):
        EngineOptions(capture="soon").check()


def write_script(root: Path, text: str) -> Path:
    path = root / "show.yaml"
    path.write_text(text)
    return path


def which_avatar(frame: np.ndarray, avatars: dict, step: int) -> str:
    """Name of the avatar whose source frame matches `frame` exactly outside all boxes."""
    boxes = []
    for a in avatars.values():
        boxes.append(a.boxes[ping_pong(step, a.num_frames)].tolist())
    keep = outside_box(frame, boxes)
    hits = [n for n, a in avatars.items() if np.array_equal(frame[keep], a.frames[ping_pong(step, a.num_frames)].numpy()[keep])]
    assert len(hits) == 1, hits
    return hits[0]


@pytest.mark.slow
def test_broadcast_three_scenes_cuts_on_the_right_frames(studio, tiny_models, tmp_path):
    script = write_script(studio, """
avatars: avatars
scenes:
  - {avatar: anna, audio: a.wav}
  - {avatar: ben, audio: b.wav}
  - {avatar: cleo, audio: c.wav}
""")
    out = tmp_path / "show.mp4"
    render_program(load_script(script), out, tiny_models, RenderOptions(crf=0, progress=False))
    frames, info = decode(out)
    assert len(frames) == math.ceil(2.6 * FPS) and abs(info["audio_s"] - 2.6) < 0.03
    avatars = {n: load_avatar(studio / "avatars" / n) for n in ("anna", "ben", "cleo")}
    starts = {"anna": 0, "ben": 8, "cleo": 19}  # round(0.8 * 10), round(1.9 * 10)
    for j, frame in enumerate(frames):
        expected = "anna" if j < 8 else "ben" if j < 19 else "cleo"
        assert which_avatar(frame, avatars, j - starts[expected]) == expected, j


@pytest.mark.slow
def test_crossfade_blends_the_right_frames(studio, tiny_models, tmp_path):
    script = write_script(studio, """
avatars: avatars
scenes:
  - {avatar: anna, audio: a.wav}
  - {avatar: ben, audio: b.wav, transition: {crossfade: 4}}
""")
    out = tmp_path / "fade.mp4"
    render_program(load_script(script), out, tiny_models, RenderOptions(crf=0, progress=False))
    frames, _ = decode(out)
    anna, ben = load_avatar(studio / "avatars" / "anna"), load_avatar(studio / "avatars" / "ben")
    for j in range(8, 12):  # the first 4 frames of scene 2
        local, prev = j - 8, j
        ka, kb = ping_pong(prev, anna.num_frames), ping_pong(local, ben.num_frames)
        weight = (local + 1) / 5
        keep = outside_box(frames[j], [anna.boxes[ka].tolist(), ben.boxes[kb].tolist()])
        mix = np.round(anna.frames[ka].numpy().astype(np.float32) * (1 - weight)
                       + ben.frames[kb].numpy().astype(np.float32) * weight)
        assert np.abs(frames[j][keep].astype(int) - mix[keep]).max() <= 1, j
    assert which_avatar(frames[7], {"anna": anna, "ben": ben}, 7) == "anna"
    assert which_avatar(frames[12], {"anna": anna, "ben": ben}, 4) == "ben"


def test_camera_cut_inside_a_scene(studio, tiny_models, tmp_path):
    script = write_script(studio, """
avatars: avatars
scenes:
  - audio: b.wav
    cameras: [{at: 0, avatar: cleo}, {at: 0.5, avatar: anna}]
""")
    out = tmp_path / "cams.mp4"
    render_program(load_script(script), out, tiny_models, RenderOptions(crf=0, progress=False))
    frames, _ = decode(out)
    avatars = {n: load_avatar(studio / "avatars" / n) for n in ("anna", "cleo")}
    assert [which_avatar(f, avatars, j) for j, f in enumerate(frames)] == ["cleo"] * 5 + ["anna"] * 6


# ---- bad inputs: a clear error and no file left ----

@pytest.mark.parametrize("case", ["unknown-avatar", "corrupt-audio", "empty-audio", "no-audio-stream",
                                  "nan-audio", "inf-audio", "missing-folder", "output-is-folder"])
def test_bad_inputs_leave_no_file(studio, tiny_models, tmp_path, case):
    audio, avatar, out = studio / "a.wav", "anna", tmp_path / "out.mp4"
    if case == "unknown-avatar":
        avatar, match = "nobody", "unknown avatar"
    elif case == "corrupt-audio":
        audio = tmp_path / "bad.wav"
        audio.write_bytes((studio / "a.wav").read_bytes()[:3000])
        match = "truncated"
    elif case == "empty-audio":
        audio = tmp_path / "empty.wav"
        audio.write_bytes(b"")
        match = "empty"
    elif case == "no-audio-stream":
        audio, match = studio / "anna.mp4", "no audio stream"
    elif case in ("nan-audio", "inf-audio"):  # a float WAV can hold them; the AAC encoder stopped on them
        samples = speech_like(0.8, 16000, seed=3)
        samples[4000:4010] = np.nan if case == "nan-audio" else np.inf
        audio = write_audio(tmp_path / "bad.wav", samples, 16000, codec="pcm_f32le")
        match = "NaN or infinite"
    elif case == "missing-folder":
        out, match = tmp_path / "nowhere" / "out.mp4", "does not exist"
    else:
        out, match = tmp_path, "is a folder"
    with pytest.raises(InputError, match=match):
        render_program(single_scene(avatar, audio), out, tiny_models,
                       RenderOptions(avatars_dir=studio / "avatars", progress=False))
    assert not [p for p in tmp_path.rglob("*") if p.suffix in (".mp4", ".part")]


@pytest.mark.parametrize("text, match", [
    ("scenes: [", "not valid YAML"),
    ("fps: 25", "non-empty 'scenes:'"),
    ("scenes: [{avatar: anna}]", "missing 'audio'"),
    ("scenes: [{audio: a.wav, avatar: anna, cameras: []}]", "either 'avatar' or 'cameras'"),
    ("scenes: [{audio: a.wav, avatar: anna}, {audio: a.wav, avatar: ben, transition: wipe}]", "transition"),
    ("scenes: [{audio: a.wav, cameras: [{at: 1, avatar: anna}]}]", "first camera must start at 0"),
    ("scenes: [{audio: a.wav, avatar: anna, volume: 3}]", "scene 1: unknown key .volume."),
])
def test_malformed_scripts(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match=match) as info:
        load_script(path)
    assert str(path) in str(info.value)


def _cli(args, cwd, env_extra=None):
    exe = shutil.which("lipstream", path=os.path.dirname(sys.executable)) or shutil.which("lipstream")
    cmd = [exe] if exe else [sys.executable, "-m", "lipstream"]  # no console script: lipstream on PYTHONPATH only
    env = {**os.environ, "COLUMNS": "200", **(env_extra or {})}
    return subprocess.Popen([*cmd, *map(str, args)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_render_writes_nothing_but_its_output(studio, tmp_path):
    work, scratch = tmp_path / "cwd", tmp_path / "tmp"
    work.mkdir()
    scratch.mkdir()
    before = sorted(p.name for p in studio.rglob("*"))
    p = _cli(["render", "--avatar", "anna", "--avatars", studio / "avatars", "--audio", studio / "a.wav",
              "-o", "out.mp4", "--random-weights", "--random-size", "tiny", "--device", "cpu"], work,
             {"TMPDIR": str(scratch), "TEMP": str(scratch), "TMP": str(scratch)})
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert sorted(x.name for x in work.iterdir()) == ["out.mp4"]
    assert list(scratch.iterdir()) == []
    assert sorted(p.name for p in studio.rglob("*")) == before


@pytest.mark.slow
def test_ctrl_c_stops_cleanly(studio, tmp_path):
    audio = write_audio(tmp_path / "speech.wav", speech_like(40.0), 16000)
    p = _cli(["render", "--avatar", "anna", "--avatars", studio / "avatars", "--audio", audio, "-o", "out.mp4",
              "--random-weights", "--random-size", "tiny", "--device", "cpu", "--batch", "4"], tmp_path)
    deadline = time.time() + 120
    while time.time() < deadline and not any(x.suffix == ".part" for x in tmp_path.iterdir()):
        time.sleep(0.2)
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, err = p.communicate(timeout=60)
    stopped_after = time.monotonic() - sent
    assert p.returncode == 130, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("interrupted"), err  # one line says so
    # It stops at once (the interpreter's teardown of torch took seconds: skipped once the output is
    # cleaned up). The bound leaves room for a loaded 2-core CI machine.
    assert stopped_after < 3.0, stopped_after
    assert sorted(x.name for x in tmp_path.iterdir()) == ["speech.wav"]


def test_output_tags_the_colour_matrix(studio, tiny_models, tmp_path):
    out = tmp_path / "tag.mp4"
    render_program(single_scene("cleo", studio / "c.wav"), out, tiny_models,
                   RenderOptions(avatars_dir=studio / "avatars", progress=False))
    _, info = decode(out)
    assert info["colorspace"] == 6  # bt601 (smpte170m), what the loop's YUV means


def test_models_must_match_the_avatar_vae(studio, tmp_path):
    other = load_musetalk(random_weights=True, size="tiny", seed=7, warn=False)
    with pytest.raises(InputError, match="another VAE"):
        render_program(single_scene("anna", studio / "a.wav"), tmp_path / "x.mp4", other,
                       RenderOptions(avatars_dir=studio / "avatars", progress=False))
    assert not list(tmp_path.iterdir())
    torch.manual_seed(0)


# ---- resident avatars: loaded once per process, reloaded when recompiled ----

@pytest.mark.slow
def test_a_second_render_reuses_the_resident_avatar(studio, tiny_models, tmp_path):
    from lipstream.avatar import resident

    resident.drop_resident()
    program = single_scene("ben", studio / "c.wav")
    outputs = []
    for name in ("one.mp4", "two.mp4"):
        outputs.append(tmp_path / name)
        render_program(program, outputs[-1], tiny_models, RenderOptions(avatars_dir=studio / "avatars", progress=False))
    assert len(resident._RESIDENT) == 1
    kept = next(iter(resident._RESIDENT.values()))
    first, _ = decode(outputs[0])
    second, _ = decode(outputs[1])
    assert len(first) == len(second) and all(np.array_equal(a, b) for a, b in zip(first, second))
    # the engine casts its copy's latents; the resident avatar keeps what was loaded
    assert kept.latents.dtype == load_avatar(studio / "avatars" / "ben", with_frames=False).latents.dtype
    again = resident.resident_avatar(studio / "avatars" / "ben", "cpu", vae_fingerprint=tiny_models.fingerprints["vae"])
    assert again is not kept and again.frames is kept.frames  # a copy sharing the loaded frames


def test_a_recompiled_avatar_is_loaded_afresh(studio, tiny_models, tmp_path, monkeypatch):
    from lipstream.avatar import resident

    resident.drop_resident()
    folder = studio / "avatars" / "cleo"
    a = resident.resident_avatar(folder, "cpu")
    meta = folder / "avatar.json"
    os.utime(meta, ns=(meta.stat().st_atime_ns, meta.stat().st_mtime_ns + 10**9))  # as a recompile would
    b = resident.resident_avatar(folder, "cpu")
    assert b.frames is not a.frames
    monkeypatch.setenv("LIPSTREAM_RESIDENT_GIB", "0")
    c = resident.resident_avatar(folder, "cpu")
    assert c.frames is not b.frames
    monkeypatch.setenv("LIPSTREAM_RESIDENT_GIB", str(1 / 2**30))  # one byte: only the latest stays
    resident.resident_avatar(studio / "avatars" / "anna", "cpu")
    assert len(resident._RESIDENT) == 1
