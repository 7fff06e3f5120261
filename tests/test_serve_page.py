"""The web page of `lipstream serve` (/) in a real headless Chromium, driven by Playwright.

Chromium's fake devices stand in for the user: the fake microphone plays a WAV and media permission is
granted without a prompt. The server is the real one on loopback (tiny networks on the CPU), its avatar
at 4 frames/s and its live options eased (see `server`): what a 2-core machine renders in time with
Chromium beside it (10 fps speech, or the realtime preset's Whisper windows, are late there, and a late
frame holds the picture). What is checked is what a user sees and hears: in the page's <video> the
presenter's mouth is not its idle mouth while speech plays, the audio track carries sound, and a job
from the form plays in the page.
"""

from __future__ import annotations

import base64
import json
import logging
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from lipstream.fixtures import speech_like, write_audio
from lipstream.fixtures.avatar import tracked_avatar

pytestmark = pytest.mark.slow  # a real Chromium: `make test` only

try:
    from playwright.sync_api import sync_playwright
except ImportError:
    pytest.skip("no playwright module (pip install playwright)", allow_module_level=True)
CHROMIUM = shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip("no chromium on PATH (apt-get install chromium; `make test` does)", allow_module_level=True)

KEY = "page-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
FPS = 4

# `n` pictures of the page's <video>, `every` ms apart, in grey (base64), and how many frames it presented
# meanwhile (requestVideoFrameCallback). On a wall clock, not a frame each: on a loaded machine a late
# frame holds the picture (up to the next IDR with H.264), and the sampling goes on past it
SNAPSHOTS = """async ([n, every]) => {
  const video = document.getElementById("remote");
  const canvas = Object.assign(document.createElement("canvas"), { width: video.videoWidth, height: video.videoHeight });
  const g = canvas.getContext("2d", { willReadFrequently: true });
  let presented = 0, counting = true;
  const count = () => { presented++; if (counting) video.requestVideoFrameCallback(count); };
  video.requestVideoFrameCallback(count);
  const out = [];
  for (let k = 0; k < n; k++) {
    await new Promise((resolve) => setTimeout(resolve, every));
    g.drawImage(video, 0, 0);
    const rgba = g.getImageData(0, 0, canvas.width, canvas.height).data;
    const grey = new Uint8Array(rgba.length / 4);
    for (let i = 0; i < grey.length; i++) grey[i] = (77 * rgba[4 * i] + 150 * rgba[4 * i + 1] + 29 * rgba[4 * i + 2]) >> 8;
    let text = "";
    for (let i = 0; i < grey.length; i += 8192) text += String.fromCharCode(...grey.subarray(i, i + 8192));
    out.push(btoa(text));
  }
  counting = false;
  return [canvas.width, canvas.height, out, presented];
}"""

AUDIO_IN = """async () => {
  let out = null;
  (await window.lipstream.pc.getStats()).forEach((s) => {
    if (s.type === "inbound-rtp" && s.kind === "audio") out = [s.packetsReceived, s.totalAudioEnergy];
  });
  return out;
}"""


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_models) -> Path:
    root = tmp_path_factory.mktemp("page")
    tracked_avatar(root, "anna", tiny_models.vae, tiny_models.fingerprints["vae"], width=320, height=180,
                   fps=FPS, seconds=1.5, seed=0)
    write_audio(root / "hello.wav", speech_like(2.5, 16_000, seed=3), 16_000)
    write_audio(root / "speech.wav", speech_like(4.0, 16_000, seed=5), 16_000)
    write_audio(root / "long.wav", speech_like(6.0, 44_100, seed=4), 44_100, channels=2)  # mixed down, resampled
    write_audio(root / "mic.wav", speech_like(3.0, 48_000, seed=7), 48_000)  # what the fake microphone hears
    (root / "notes.txt").write_text("not audio")
    return root


@pytest.fixture(scope="module")
def server(root, tiny_models):
    """A started Service behind uvicorn on 127.0.0.1 (a free port), in this process; its base URL."""
    from lipstream.serve.options import ServeOptions
    from lipstream.serve.server import in_thread
    from lipstream.serve.service import Service

    # The realtime preset is the GPU's: here a microphone session falls behind for good within seconds (its
    # audio comes in real time, 20 ms a packet). The cpu preset (Whisper every 200 ms, 1 s behind) keeps a
    # 2-core machine on time, Chromium beside it. The capacity is given: a loaded machine measures too
    # little to admit a session.
    options = ServeOptions(root / "avatars", root / "data", api_keys=(KEY,), max_audio_s=10.0, live_preset="cpu",
                           live_capacity_fps=35.0)
    service = Service(options, tiny_models).start()
    with in_thread(service) as url:
        yield url


@pytest.fixture(scope="module")
def browser(root):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox",  # CI runs as root, where Chromium's sandbox does not start
            "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={root / 'mic.wav'}", "--autoplay-policy=no-user-gesture-required"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser, server):
    """The page with the key typed in (a first load without it shows the API's 401 on the page)."""
    context = browser.new_context()
    page = context.new_page()
    thrown = []  # uncaught exceptions in the page's scripts
    page.on("pageerror", lambda error: thrown.append(str(error)))
    page.goto(server + "/")
    page.wait_for_selector("#error:not([hidden])")
    assert page.text_content("#error").startswith("401: a valid API key is needed")
    page.fill("#key", KEY)
    page.dispatch_event("#key", "change")
    page.wait_for_function("() => document.getElementById('avatar').value === 'anna'")
    assert page.is_hidden("#error")
    page.reload()  # the key is kept (localStorage)
    page.wait_for_function("() => document.getElementById('avatar').value === 'anna'")
    assert page.input_value("#key") == KEY and page.is_hidden("#error")
    yield page
    if page.evaluate("() => window.lipstream.pc !== null"):  # a test that failed midway: end its session
        _stop(page, server)
    context.close()
    assert not thrown, thrown


def _start(page, mic: bool) -> None:
    """Start: the video plays in the page, and the audio track's packets come in."""
    page.set_checked("#mic", mic)
    page.click("#start")
    page.wait_for_function("() => { const v = document.getElementById('remote'); return v.readyState >= 2 && "
                           "v.videoWidth === 320 && window.lipstream.session }", timeout=20_000)
    t = time.monotonic()
    while not (page.evaluate(AUDIO_IN) or [0])[0]:
        assert time.monotonic() - t < 10, "no audio packets"
        time.sleep(0.1)


def _stop(page, server: str) -> None:
    page.click("#start")
    page.wait_for_function("() => window.lipstream.pc === null && document.getElementById('start').textContent "
                           "=== 'Start'")
    assert httpx.get(server + "/v1/sessions", headers=AUTH).json() == []  # DELETEd, not left to time out
    assert page.is_hidden("#error"), page.text_content("#error")
    page.wait_for_timeout(300)  # the speech socket's close (4410, the session ended) comes after: no error
    assert page.evaluate("() => window.lipstream.errors") == []


def _snapshots(page, n: int, every_ms: int = 250) -> tuple[np.ndarray, int]:
    width, height, shots, presented = page.evaluate(SNAPSHOTS, [n, every_ms])
    pictures = [np.frombuffer(base64.b64decode(s), np.uint8).reshape(height, width) for s in shots]
    return np.stack(pictures).astype(float), presented


def _wait_event(page, kind: str, timeout: float = 15_000) -> None:
    page.wait_for_function(f"() => window.lipstream.events.some(e => e.kind === '{kind}')", timeout=timeout)


@pytest.fixture(scope="module")
def mouth(root) -> tuple[slice, slice]:
    """The rows and columns the loop's mouth moves in (its landmarks 48-67, from the avatar's track file)."""
    lips = np.array(json.loads((root / "anna.track.json").read_text())["landmarks"])[:, 48:68]
    (x0, y0), (x1, y1) = lips.min(axis=(0, 1)), lips.max(axis=(0, 1))
    return slice(int(y0) - 2, int(y1) + 3), slice(int(x0) - 2, int(x1) + 3)


@pytest.fixture(scope="module")
def idle(browser, server, mouth) -> np.ndarray:
    """The idle presenter as the page shows it: every frame of its ping-pong loop (6 frames, 2.5 s a cycle),
    sampled 8 times a second for 3 s."""
    context = browser.new_context()
    page = context.new_page()
    page.goto(server + "/")
    page.evaluate("key => localStorage.setItem('lipstream.key', key)", KEY)
    page.reload()
    page.wait_for_function("() => document.getElementById('avatar').value === 'anna'")
    _start(page, mic=False)
    frames, presented = _snapshots(page, 24, 125)
    assert presented >= 8, presented  # 12 at 4 frames/s
    _stop(page, server)
    context.close()
    return frames


def _speaking(shots: np.ndarray, idle: np.ndarray, mouth) -> list[tuple[float, float]]:
    """Per snapshot: how far it is from the idle frame it matches best outside the mouth, and how far their
    mouths are apart (grey levels, mean absolute). Idle against idle: under 2 in both (the codec's noise);
    a speaking mouth against the idle one: 8-15."""
    outside = np.ones(idle.shape[1:], bool)
    outside[mouth] = False
    out = []
    for shot in shots:
        diffs = np.abs(idle - shot)
        best = int(np.argmin(diffs[:, outside].mean(axis=1)))
        out.append((float(diffs[best][outside].mean()), float(diffs[best][mouth].mean())))
    return out


def _mouth_moves(snapshots: tuple[np.ndarray, int], idle, mouth, server: str) -> None:
    """Frames came and the picture moved, and at least 3 new pictures show a loop frame of the idle
    presenter (the same picture outside the mouth) with a mouth that is not the idle one. Not every
    frame: on a loaded machine a late frame holds the picture (with H.264 up to the next IDR)."""
    shots, presented = snapshots
    played = httpx.get(server + "/v1/sessions", headers=AUTH).json()  # frames_late, when this fails
    changes = [round(float(np.abs(a - b).mean()), 2) for a, b in zip(shots, shots[1:])]
    matches = [(round(a, 1), round(b, 1)) for a, b in _speaking(shots, idle, mouth)]
    print(f"{presented} frames; picture changes: {changes}; outside / mouth against the idle frame: {matches}; "
          f"{played}")
    assert presented >= 4 and sum(c > 2 for c in changes) >= 3, (presented, changes, played)
    new = [True] + [c > 2 for c in changes]
    assert sum(n and a < 3 and b > 6 for n, (a, b) in zip(new, matches)) >= 3, (matches, changes, played)


def test_live_speaks_a_file_over_the_websocket_and_the_mouth_moves(page, server, idle, mouth, root):
    """Start (no microphone), pick a file: it is decoded, sent as PCM16 and spoken; the speech events show
    in the page; a second file is cut off by Interrupt; Stop ends the session on the server."""
    _start(page, mic=False)
    before = page.evaluate(AUDIO_IN)
    page.set_input_files("#speech-file", str(root / "speech.wav"))
    _wait_event(page, "started")
    shots = _snapshots(page, 14)  # 3.5 s of the 4 s utterance
    _wait_event(page, "finished")
    after = page.evaluate(AUDIO_IN)
    _mouth_moves(shots, idle, mouth, server)
    assert after[0] > before[0] + 50  # Opus packets of 20 ms kept coming
    assert after[1] - before[1] > 0.01, (before, after)  # and what they carried was sound, not the idle silence
    assert page.locator("#speech-log li").count() == 2  # started, finished: shown as they came

    page.set_input_files("#speech-file", str(root / "long.wav"))  # stereo 44.1 kHz: mixed and resampled
    page.wait_for_function("() => window.lipstream.events.filter(e => e.kind === 'started').length === 2",
                           timeout=15_000)
    page.click("#interrupt")
    _wait_event(page, "interrupted")
    kinds = page.evaluate("() => window.lipstream.events.map(e => e.kind)")
    assert kinds == ["started", "finished", "started", "interrupted"], kinds
    _stop(page, server)


def test_live_speaks_from_the_microphone_and_the_mouth_moves(page, server, idle, mouth):
    """Start with "use microphone": the offer carries Chromium's fake microphone (a WAV), the server
    lip-syncs what it hears and reports it on the speech socket; the returned audio carries sound."""
    _start(page, mic=True)
    _wait_event(page, "started")
    before = page.evaluate(AUDIO_IN)
    shots = _snapshots(page, 24)  # 6 s: a frame late at the session's start can hold the picture a while
    after = page.evaluate(AUDIO_IN)
    _mouth_moves(shots, idle, mouth, server)
    assert after[0] > before[0] + 50 and after[1] - before[1] > 0.01, (before, after)
    _stop(page, server)


def test_a_job_from_the_form_renders_and_plays_in_the_page(page, server, root, caplog):
    """The form's job runs to done (its progress bar full, followed over server-sent events with ?token=),
    and Play shows its MP4 in the page's <video> (fetched with ?token=); an API error shows in one line;
    the request log has the paths, never the key."""
    caplog.set_level(logging.INFO, logger="lipstream.serve")
    page.set_input_files("#job-form input[name=audio]", str(root / "notes.txt"))
    page.click("#job-form button[type=submit]")
    page.wait_for_selector("#error:not([hidden])")
    assert page.text_content("#error").startswith("422: audio: a file ending in one of")

    page.set_input_files("#job-form input[name=audio]", str(root / "hello.wav"))
    page.click("#job-form button[type=submit]")
    page.wait_for_function("() => window.lipstream.jobs.length === 1")
    assert page.is_hidden("#error")
    job = page.evaluate("() => window.lipstream.jobs[0]")
    row = f"tr[data-job='{job}']"
    page.wait_for_function(f"() => document.querySelector(\"{row} progress\").value === 1 && "
                           f"document.querySelector(\"{row} td.done\") !== null", timeout=60_000)
    page.click(f"{row} button")
    page.wait_for_function("() => { const v = document.getElementById('result'); return v.readyState >= 2 && "
                           "v.videoWidth === 320 && v.currentTime > 0.5 }", timeout=20_000)
    presented = page.evaluate("""() => new Promise((resolve) => {
        const v = document.getElementById('result');
        v.requestVideoFrameCallback((now, meta) => resolve(meta.presentedFrames));
    })""")
    assert presented >= 1

    # only the two GETs a browser makes without headers take the key as ?token=
    with httpx.Client(base_url=server) as client:
        assert client.get(f"/v1/jobs/{job}/result", params={"token": KEY}).status_code == 200
        assert client.get(f"/v1/jobs/{job}/result", params={"token": "wrong-key-0123456789"}).status_code == 401
        with client.stream("GET", f"/v1/jobs/{job}/events", params={"token": KEY}) as r:
            assert r.status_code == 200 and '"status": "done"' in r.read().decode()
        assert client.get("/v1/jobs", params={"token": KEY}).status_code == 401
        assert client.get(f"/v1/jobs/{job}", params={"token": KEY}).status_code == 401
    requests = [json.loads(r.getMessage()) for r in caplog.records if '"event": "request"' in r.getMessage()]
    assert {"method": "GET", "path": f"/v1/jobs/{job}/result", "status": 206} in [
        {k: r[k] for k in ("method", "path", "status")} for r in requests]  # the page's <video>: a Range request
    assert not [r for r in caplog.records if KEY in r.getMessage()]
