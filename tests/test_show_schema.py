"""The newsroom show's script keys: good scripts parse to the spec, every bad input is one line that names
the scene and the key (the nearest valid name for a typo), before any network loads; and a broadcast job
on a real `lipstream serve` (loopback, tiny random networks) gets the show's files uploaded, its parsed
program pointing at them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import av
import httpx
import numpy as np
import pytest
from PIL import Image, ImageFont

from lipstream.errors import InputError
from lipstream.fixtures import speech_like, write_audio
from lipstream.render.script import Scene, Shot, load_script
from lipstream.show.checks import check_show, declared_durations, text_width
from lipstream.show.spec import (
    DEFAULT_FADE_S, LowerThird, Logo, Music, Picture, SceneLayers, Show, Span, Ticker)

SRC = str(Path(__file__).resolve().parents[1] / "src")
FRAME = (640, 360)


def write_png(path: Path, size=(64, 32), alpha=True) -> Path:
    rgba = np.zeros((size[1], size[0], 4), np.uint8)
    rgba[..., 0], rgba[..., 3] = 200, 255 if not alpha else 128
    Image.fromarray(rgba, "RGBA").save(path)
    return path


def write_video(path: Path, size=(96, 64), frames=5, fps=10) -> Path:
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = size[0], size[1], "yuv420p"
        for k in range(frames):
            img = np.full((size[1], size[0], 3), 20 * k, np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return path


def write_font(path: Path) -> Path:
    """A real TrueType file: the bytes of Pillow's scalable default font."""
    path.write_bytes(ImageFont.load_default(size=20).path.getvalue())
    return path


@pytest.fixture()
def desk(tmp_path) -> Path:
    """A script's folder: 2.0 s and 1.5 s of speech, a logo, a chart still, footage, a music bed, a font."""
    write_audio(tmp_path / "story1.wav", speech_like(2.0, 16_000, seed=1), 16_000)
    write_audio(tmp_path / "story2.wav", speech_like(1.5, 16_000, seed=2), 16_000)
    write_png(tmp_path / "logo.png")
    write_png(tmp_path / "chart.png", (320, 180), alpha=False)
    write_video(tmp_path / "footage.mp4")
    write_audio(tmp_path / "bed.mp3", 0.1 * np.sin(np.arange(48_000) / 48_000 * 2 * np.pi * 220), 48_000)
    (tmp_path / "fonts").mkdir()
    write_font(tmp_path / "fonts" / "news.ttf")
    return tmp_path


SHOW = """\
scenes:
  - avatar: anna
    audio: story1.wav
    lower_third: {title: "Anna Berg", subtitle: "Berlin", from: 0.5, to: 1.8}
    pip: {source: footage.mp4, box: [400, 40, 600, 160], from: 0.2, to: 2.0, loop: true, fade: 0.1}
  - avatar: ben
    text: "Markets closed higher today."
    cutaway: {source: chart.png, from: 1.0, to: 3.0}
  - cameras: [{at: 0, avatar: anna}, {at: 0.5, avatar: ben}]
    audio: story2.wav
    transition: {crossfade: 4}
    lower_third: {title: 2024}
overlays:
  logo: {image: logo.png, corner: bottom-left, margin: 16, height: 24}
  ticker: {text: "Breaking: markets up", speed: 90}
music: {file: bed.mp3, gain_db: -20, duck_db: -10, loop: false}
font: fonts/news.ttf
voice: en-us
"""


def script(folder: Path, text: str) -> Path:
    path = folder / "show.yaml"
    path.write_text(text)
    return path


def one_line_error(path: Path, call=load_script) -> str:
    with pytest.raises(InputError) as info:
        call(path)
    message = str(info.value)
    assert "\n" not in message
    return message


# -- the parse -----------------------------------------------------------------------------------------------

def test_a_complete_show_parses_to_the_spec(desk):
    program = load_script(script(desk, SHOW))
    assert [s.audio for s in program.scenes] == [desk / "story1.wav", None, desk / "story2.wav"]
    assert [s.text for s in program.scenes] == [None, "Markets closed higher today.", None]
    assert program.scenes[2].shots == [Shot(0.0, "anna"), Shot(0.5, "ben")] and program.scenes[2].crossfade == 4
    assert program.show == Show(
        scenes=[SceneLayers(lower_third=LowerThird("Anna Berg", "Berlin", Span(0.5, 1.8)),
                            pip=Picture(desk / "footage.mp4", (400, 40, 600, 160), Span(0.2, 2.0, 0.1), loop=True)),
                SceneLayers(cutaway=Picture(desk / "chart.png", None, Span(1.0, 3.0))),
                SceneLayers(lower_third=LowerThird("2024", "", Span(0.0, None, DEFAULT_FADE_S)))],
        logo=Logo(desk / "logo.png", "bottom-left", 16, 24), ticker=Ticker("Breaking: markets up", 90.0),
        music=Music(desk / "bed.mp3", -20.0, -10.0, loop=False), font=desk / "fonts" / "news.ttf", voice="en-us")
    assert program.show.visual()
    assert program.show.files() == [desk / "footage.mp4", desk / "chart.png", desk / "logo.png", desk / "bed.mp3",
                                    desk / "fonts" / "news.ttf"]
    check_show(program, FRAME, declared_durations(program))  # every file real, every layer in its frame and time


def test_a_script_without_show_keys_has_an_empty_show_and_a_piper_voice_is_a_file(desk):
    program = load_script(script(desk, "scenes: [{avatar: anna, audio: story1.wav}]\n"))
    assert program.show == Show(scenes=[SceneLayers()]) and not program.show.visual() and not program.show.files()
    assert program.scenes == [Scene(desk / "story1.wav", [Shot(0.0, "anna")])]
    program = load_script(script(desk, "voice: voices/de_DE-thorsten.onnx\nscenes: [{avatar: anna, text: Hallo}]\n"))
    assert program.show.voice == str(desk / "voices" / "de_DE-thorsten.onnx")
    assert program.show.files() == [desk / "voices" / "de_DE-thorsten.onnx"]
    assert declared_durations(program) == [None]


@pytest.mark.parametrize("text, expected", [
    # unknown keys, with the nearest valid name, in a layer, in a scene, at the top, in the overlays
    ("scenes: [{avatar: a, audio: x.wav}, {avatar: a, audio: x.wav, pip: {source: f.mp4, boxx: [0, 0, 9, 9]}}]",
     "scene 2: pip: unknown key 'boxx' (did you mean 'box'?)"),
    ("scenes: [{avatar: a, audio: x.wav, lower_thrid: {title: T}}]",
     "scene 1: unknown key 'lower_thrid' (did you mean 'lower_third'?)"),
    ("scenes: [{avatar: a, audio: x.wav, volume: 3}]",
     "scene 1: unknown key 'volume' (it takes: avatar, audio, text, cameras, start_frame, transition, model, "
     "lower_third, pip, cutaway)"),
    ("overlay: {}\nscenes: [{avatar: a, audio: x.wav}]", "unknown key 'overlay' (did you mean 'overlays'?)"),
    ("musik: {file: b.mp3}\nscenes: [{avatar: a, audio: x.wav}]", "unknown key 'musik' (did you mean 'music'?)"),
    ("overlays: {logo: {image: l.png, coner: top-left}}\nscenes: [{avatar: a, audio: x.wav}]",
     "overlays: logo: unknown key 'coner' (did you mean 'corner'?)"),
    ("overlays: {tikcer: {text: hi}}\nscenes: [{avatar: a, audio: x.wav}]",
     "overlays: unknown key 'tikcer' (did you mean 'ticker'?)"),
    ("music: {file: b.mp3, duck: -6}\nscenes: [{avatar: a, audio: x.wav}]",
     "music: unknown key 'duck' (did you mean 'duck_db'?)"),
    ("scenes: [{avatar: a, audio: x.wav, cutaway: {source: c.png, box: [0, 0, 9, 9]}}]",
     "scene 1: cutaway: unknown key 'box' (it takes: source, from, to, loop, fade)"),
    # exactly one of audio and text
    ("scenes: [{avatar: a, audio: x.wav, text: Hello}]", "scene 1: give either 'audio' or 'text', not both"),
    ("scenes: [{avatar: a}]", "scene 1: missing 'audio' (or 'text': words for the TTS to speak)"),
    ("scenes: [{avatar: a, text: '  '}]", "scene 1: text must be the words to speak, got '  '"),
    # times
    ("scenes: [{avatar: a, audio: x.wav, lower_third: {title: T, from: 3, to: 3}}]",
     "scene 1: lower_third: to (3 s) must be after from (3 s)"),
    ("scenes: [{avatar: a, audio: x.wav, pip: {source: f.mp4, box: [0, 0, 9, 9], from: -0.5}}]",
     "scene 1: pip: from -0.5 is negative: times are seconds from the scene's start"),
    ("scenes: [{avatar: a, audio: x.wav, cutaway: {source: c.png, fade: -1}}]",
     "scene 1: cutaway: fade -1 is negative: it is the seconds of fade in and out"),
    ("scenes: [{avatar: a, audio: x.wav, cutaway: {source: c.png, to: soon}}]",
     "scene 1: cutaway: to must be a number (seconds), got 'soon'"),
    # types and values
    ("scenes: [{avatar: a, audio: x.wav, pip: {source: f.mp4, box: [0, 0, 9]}}]",
     "scene 1: pip: box must be [x1, y1, x2, y2] in whole pixels, got [0, 0, 9]"),
    ("scenes: [{avatar: a, audio: x.wav, pip: {source: f.mp4, box: [50, 0, 50, 9]}}]",
     "scene 1: pip: box [50, 0, 50, 9] is empty: x2 must be above x1 and y2 above y1"),
    ("scenes: [{avatar: a, audio: x.wav, pip: {source: f.mp4, box: [-5, 0, 50, 9]}}]",
     "scene 1: pip: box [-5, 0, 50, 9] starts outside the frame (a negative coordinate)"),
    ("scenes: [{avatar: a, audio: x.wav, pip: {box: [0, 0, 9, 9]}}]", "scene 1: pip: missing 'source'"),
    ("scenes: [{avatar: a, audio: x.wav, pip: {source: f.mp4, box: [0, 0, 9, 9], loop: yes please}}]",
     "scene 1: pip: loop must be true or false, got 'yes please'"),
    ("scenes: [{avatar: a, audio: x.wav, pip: footage.mp4}]",
     "scene 1: pip must be a mapping of source, box, from, to, loop, fade, got 'footage.mp4'"),
    ("scenes: [{avatar: a, audio: x.wav, lower_third: {title: \"a\\nb\"}}]",
     "scene 1: lower_third: title must be one line of text"),
    ("overlays: {logo: {image: l.png, corner: top-rigth}}\nscenes: [{avatar: a, audio: x.wav}]",
     "overlays: logo: corner 'top-rigth' is not a corner (did you mean 'top-right'?)"),
    ("overlays: {logo: {image: l.png, corner: middle}}\nscenes: [{avatar: a, audio: x.wav}]",
     "overlays: logo: corner 'middle' is not a corner (one of top-left, top-right, bottom-left, bottom-right)"),
    ("overlays: {logo: {image: l.png, height: 0}}\nscenes: [{avatar: a, audio: x.wav}]",
     "overlays: logo: height must be a whole number of pixels >= 1, got 0"),
    ("overlays: {ticker: {text: hi, speed: 0}}\nscenes: [{avatar: a, audio: x.wav}]",
     "overlays: ticker: speed must be above 0 (pixels per second), got 0"),
    ("overlays: {ticker: {text: hi, speed: -40}}\nscenes: [{avatar: a, audio: x.wav}]",
     "overlays: ticker: speed must be above 0 (pixels per second), got -40"),
    ("music: {file: b.mp3, duck_db: 6}\nscenes: [{avatar: a, audio: x.wav}]",
     "music: duck_db must be 0 or below (dB the music drops under speech), got 6"),
    ("music: {gain_db: -6}\nscenes: [{avatar: a, audio: x.wav}]", "music: missing 'file'"),
    ("voice: 'my voice/x'\nscenes: [{avatar: a, text: hi}]",
     "voice 'my voice/x' is neither an espeak-ng voice name (en, en-us, de) nor a Piper .onnx file"),
    ("font: 12\nscenes: [{avatar: a, audio: x.wav}]", "font must be a file name, got 12"),
])
def test_a_bad_script_is_one_line_naming_the_scene_and_key(tmp_path, text, expected):
    path = script(tmp_path, text)
    assert one_line_error(path) == f"{path}: {expected}"


# -- the checks that need the frame, the scenes' lengths and the files ----------------------------------------

def _with(desk: Path, old: str, new: str):
    text = SHOW.replace(old, new)
    assert text != SHOW
    return load_script(script(desk, text))


@pytest.mark.parametrize("old, new, expected", [
    ("box: [400, 40, 600, 160]", "box: [400, 40, 680, 160]",
     "{script}: scene 1: pip: box [400, 40, 680, 160] is outside the 640x360 frame"),
    ("box: [400, 40, 600, 160]", "box: [400, 300, 600, 361]",
     "{script}: scene 1: pip: box [400, 300, 600, 361] is outside the 640x360 frame"),
    ("from: 0.5, to: 1.8", "from: 0.5, to: 2.5", "{script}: scene 1: lower_third: to 2.5 s is past the scene's end "
                                                 "(2.00 s)"),
    ("from: 0.2, to: 2.0", "from: 2.0", "{script}: scene 1: pip: from 2 s is past the scene's end (2.00 s)"),
    ("lower_third: {title: 2024}", "lower_third: {title: 2024, from: 1.0, to: 1.6}",
     "{script}: scene 3: lower_third: to 1.6 s is past the scene's end (1.50 s)"),
    ("source: footage.mp4", "source: gone.mp4", "{desk}/gone.mp4: no such video file (scene 1: pip: source)"),
    ("source: chart.png", "source: charts/chart.png",
     "{desk}/charts/chart.png: no such image (scene 2: cutaway: source)"),
    ("image: logo.png", "image: logo.svg.png", "{desk}/logo.svg.png: no such image (overlays: logo: image)"),
    ("file: bed.mp3", "file: beds", "{desk}/beds: is a folder, expected an audio file (music: file)"),
    ("font: fonts/news.ttf", "font: fonts/none.ttf", "{desk}/fonts/none.ttf: no such font file (font:)"),
    ("voice: en-us", "voice: de.onnx", "{desk}/de.onnx: no such Piper voice file (voice:)"),
    ("source: footage.mp4", "source: notes.mp4",
     "{desk}/notes.mp4: not a readable video file (scene 1: pip: source: Invalid data found when processing input)"),
    ("source: footage.mp4", "source: story2.wav",
     "{desk}/story2.wav: has no video stream (scene 1: pip: source: expected a video file or an image)"),
    ("source: chart.png", "source: broken.png", "{desk}/broken.png: not an image Pillow can read (scene 2: "
                                                "cutaway: source: not a known image format)"),
    ("file: bed.mp3", "file: chart.png", "{desk}/chart.png: has no audio stream (music: file: expected an audio file)"),
    ("font: fonts/news.ttf", "font: notes.ttf", "{desk}/notes.ttf: not a font Pillow can read (font: expected a "
                                                "TrueType or OpenType file)"),
    ("height: 24", "height: 400", "{script}: overlays: logo: 800x400 at margin 16 does not fit in the 640x360 frame "
                                  "(set a smaller height:)"),
])
def test_what_the_show_cannot_do_is_one_line(desk, old, new, expected):
    (desk / "notes.mp4").write_text("not a video at all")
    (desk / "notes.ttf").write_text("not a font either")
    (desk / "broken.png").write_bytes(b"garbage, not a picture" * 10)
    (desk / "beds").mkdir()
    program = _with(desk, old, new)
    message = one_line_error(program, lambda p: check_show(p, FRAME, declared_durations(p)))
    assert message == expected.format(script=desk / "show.yaml", desk=desk)


def test_a_title_too_wide_for_the_frame_is_one_line_and_the_width_is_pillows(desk):
    title = "The longest name a lower third was ever asked to hold, and then some"
    program = _with(desk, 'title: "Anna Berg"', f'title: "{title}"')
    message = one_line_error(program, lambda p: check_show(p, FRAME, None))
    assert message.startswith(f"{desk / 'show.yaml'}: scene 1: lower_third: title 'The longest name a lower third "
                              "was ever…' does not fit: ")
    size = round(360 * 0.055)
    wide = ImageFont.truetype(str(desk / "fonts" / "news.ttf"), size).getlength(title)
    assert f"{wide:.0f} px wide at {size} px, the 640 px frame has 576 px" in message and wide > 576
    assert text_width(title, size, desk / "fonts" / "news.ttf") == wide
    assert text_width(title, size) == pytest.approx(wide, rel=0.02)  # that file is the default font's bytes
    check_show(program, (1280, 360), None)  # the same title at the same size fits a wider frame


def test_a_text_scene_has_no_length_before_the_tts_so_only_its_times_order_is_checked(desk):
    program = _with(desk, "from: 1.0, to: 3.0", "from: 1.0, to: 300.0")
    assert declared_durations(program)[1] is None
    check_show(program, FRAME, declared_durations(program))


def test_broadcast_stops_on_a_bad_show_before_torch_is_imported(desk):
    """The real CLI in a fresh interpreter, avatars that are metadata only: the show's frame check is
    made with the avatar's size and the audio's declared length, and nothing heavy is imported."""
    for name in ("anna", "ben"):
        (desk / "avatars" / name).mkdir(parents=True)
        (desk / "avatars" / name / "avatar.json").write_text(json.dumps({"width": 640, "height": 360, "fps": "25"}))
    probe = ("import sys; from lipstream.cli import main; code = main(sys.argv[1:]); "
             "print('torch-imported' if 'torch' in sys.modules else 'torch-not-imported'); sys.exit(code)")
    script(desk, SHOW.replace("box: [400, 40, 600, 160]", "box: [400, 40, 700, 160]"))
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(desk), "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p)}
    p = subprocess.run([sys.executable, "-c", probe, "broadcast", "show.yaml", "-o", "out.mp4", "--avatars", "avatars",
                        "--random-weights"], cwd=desk, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1, p.stderr
    assert p.stderr.strip() == "error: show.yaml: scene 1: pip: box [400, 40, 700, 160] is outside the 640x360 frame"
    assert "torch-not-imported" in p.stdout


# -- the server: a broadcast job's show files uploaded ---------------------------------------------------------

KEY = "show-schema-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_models):
    """A started Service behind uvicorn on 127.0.0.1 (a free port), in this process; one 320x180 avatar."""
    from lipstream.fixtures.avatar import tracked_avatar
    from lipstream.serve.options import ServeOptions
    from lipstream.serve.server import in_thread
    from lipstream.serve.service import Service

    root = tmp_path_factory.mktemp("serve")
    tracked_avatar(root, "anna", tiny_models.vae, tiny_models.fingerprints["vae"], width=320, height=180, seed=0)
    options = ServeOptions(root / "avatars", root / "data", api_keys=(KEY,), max_upload_mb=2.0, max_audio_s=10.0,
                           jobs_per_key=2, live_capacity_fps=35.0, rtc_workers=1)
    service = Service(options, tiny_models).start()
    with in_thread(service) as url:
        yield url, service


SERVER_SHOW = """\
scenes:
  - avatar: anna
    audio: sounds/story1.wav
    lower_third: {title: "Anna Berg", subtitle: "Berlin", from: 0.2, to: 1.0, fade: 0.1}
    pip: {source: media/footage.mp4, box: [200, 20, 300, 90], from: 0.2, loop: true}
  - avatar: anna
    audio: story2.wav
    cutaway: {source: chart.png, from: 0.5, to: 1.0}
overlays:
  logo: {image: logo.png, corner: top-left, margin: 8, height: 20}
  ticker: {text: "Breaking: markets up", speed: 60}
music: {file: bed.mp3, gain_db: -18, duck_db: -12}
font: fonts/news.ttf
"""


@pytest.mark.slow
def test_a_broadcast_job_uploads_the_shows_files_and_the_server_program_points_at_them(server, desk, tmp_path):
    """`--server` mode's client (remote_jobs: prepare_upload, run_job) against the real server: the show's
    files go up with the audio under the names the script sent names them by; the program the server
    parses from its stored script has every layer of the local one, each file its uploaded copy."""
    from lipstream.client.jobs import JobServer, OutputOptions, run_job
    from lipstream.client.upload import prepare_upload

    url, service = server
    (desk / "sounds").mkdir()
    (desk / "story1.wav").rename(desk / "sounds" / "story1.wav")
    write_audio(desk / "story1.wav", speech_like(0.4, 16_000, seed=9), 16_000)  # another file of the same name
    (desk / "media").mkdir()
    (desk / "footage.mp4").rename(desk / "media" / "footage.mp4")
    program = load_script(script(desk, SERVER_SHOW))
    upload = prepare_upload(program, "broadcast", tmp_path / "out.mp4")
    assert list(upload.audio) == ["01-story1.wav", "02-story2.wav"]
    assert list(upload.files) == ["show01-footage.mp4", "show02-chart.png", "show03-logo.png", "show04-bed.mp3",
                                  "show05-news.ttf"]
    with JobServer(url, KEY) as remote:
        result = run_job(remote, upload, OutputOptions(fps=Fraction(10)), tmp_path / "out.mp4")
    assert result.frames == 35 and (tmp_path / "out.mp4").is_file()  # 2.0 s + 1.5 s at 10 fps

    job = service.store.get(result.job_id)
    stored = service.o.data_dir / job.params["script"]
    there = load_script(stored)
    folder = stored.parent
    sent = dict(zip(program.show.files(), there.show.files(), strict=True))
    for local, copy in sent.items():
        assert copy.parent == folder and copy.read_bytes() == local.read_bytes()
    assert [s.audio.read_bytes() for s in there.scenes] == [s.audio.read_bytes() for s in program.scenes]

    def by_name(show: Show, name) -> Show:  # every path by its file's name: the rest must be the same show
        def pic(p):
            return p and replace(p, source=name(p.source))

        return replace(show, scenes=[replace(s, pip=pic(s.pip), cutaway=pic(s.cutaway)) for s in show.scenes],
                       logo=replace(show.logo, image=name(show.logo.image)),
                       music=replace(show.music, file=name(show.music.file)), font=name(show.font))

    assert by_name(there.show, lambda p: p.name.split("-", 1)[1]) == by_name(program.show, lambda p: p.name)
    assert there.show.scenes[0].lower_third == LowerThird("Anna Berg", "Berlin", Span(0.2, 1.0, 0.1))


@pytest.mark.slow
def test_the_server_refuses_a_show_that_is_not_sent_or_cannot_be_shown(server, desk):
    """Each refusal is a 422 with one line that names the key and never the server's folders; nothing is kept."""
    url, service = server
    before = len(service.store.list())
    uploads = service.o.data_dir / "uploads"
    kept = set(uploads.iterdir()) if uploads.is_dir() else set()

    def submit(text: str, files: dict[str, Path], audio=("story1.wav",)):
        parts = [("script", ("script.yaml", text.encode(), "application/yaml"))]
        parts += [("audio", (n, (desk / n).read_bytes(), "audio/wav")) for n in audio]
        parts += [("files", (n, p.read_bytes(), "application/octet-stream")) for n, p in files.items()]
        return httpx.post(f"{url}/v1/jobs/broadcast", files=parts, headers=AUTH, timeout=60)

    base = "scenes:\n  - {avatar: anna, audio: story1.wav, pip: {source: s1.png, box: [10, 10, 100, 60]}}\n"
    logo = {"s1.png": desk / "logo.png"}
    cases = [
        (base, {}, "script: 's1.png': the show's files must be among the files sent: []"),
        (base.replace("s1.png", "../s1.png"), logo, "script: 's1.png': the show's files must be among the files "
                                                     "sent: ['s1.png']"),
        (base, {"s1.exe": desk / "logo.png"}, "files: 's1.exe': a file name"),
        (base, {"story1.wav": desk / "logo.png"}, "audio, files: distinct file names"),
        (base.replace("[10, 10, 100, 60]", "[10, 10, 400, 60]"), logo,
         "script: scene 1: pip: box [10, 10, 400, 60] is outside the 320x180 frame"),
        (base.replace("box: [10, 10, 100, 60]", "box: [10, 10, 100, 60], to: 9"), logo,
         "script: scene 1: pip: to 9 s is past the scene's end (2.00 s)"),
        (base, {"s1.png": desk / "story2.wav"}, "script: s1.png: not an image Pillow can read (scene 1: pip: source: "
                                                "not a known image format)"),
        (base.replace("box", "boxx"), logo, "script: script.yaml: scene 1: pip: unknown key 'boxx' (did you mean "),
    ]
    for text, files, expected in cases:
        r = submit(text, files)
        assert r.status_code == 422, (expected, r.text)
        detail = r.json()["detail"]
        assert expected in detail and "\n" not in detail, (expected, detail)
        if "script.yaml" not in expected:
            assert str(service.o.data_dir) not in detail
    assert len(service.store.list()) == before
    assert not [p for p in uploads.iterdir() if p not in kept and any(p.iterdir())]  # nothing kept
    r = submit("scenes:\n  - {avatar: anna, text: Hello there}\n", {}, audio=())
    assert r.status_code == 202, r.text  # a show of text scenes alone sends no audio (the TTS speaks it there)
    service.store.cancel(r.json()["id"])
