"""lipstream.client: a RemoteSession against a real `lipstream serve` on loopback (uvicorn, tiny networks on
the CPU), over real WebRTC (aiortc) and the speech WebSocket."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import httpx
import numpy as np
import pytest

from lipstream.fixtures import speech_like
from lipstream.fixtures.avatar import tracked_avatar
from lipstream.live import LiveFrame, SpeakingSession, SpeechEvent

KEY = "client-key-0123456789abcdef"
SRC = str(Path(__file__).resolve().parents[1] / "src")
FPS = Fraction(5)  # what 2 CPU cores render in time, with a 1.5 s playout delay
DELAY_S = 1.5


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_models):
    """A started Service behind uvicorn on 127.0.0.1 (a free port), in this process: capacity for two 5 fps
    sessions (12 frames/s at 95%), so a third is refused. Two avatars of one frame size (camera cuts), one of
    another."""
    from lipstream.serve.options import ServeOptions
    from lipstream.serve.server import in_thread
    from lipstream.serve.service import Service

    root = tmp_path_factory.mktemp("client")
    for name, width, height, seed in (("anna", 320, 180, 0), ("ben", 320, 180, 5), ("cara", 480, 270, 1)):
        tracked_avatar(root, name, tiny_models.vae, tiny_models.fingerprints["vae"], width=width, height=height,
                       seed=seed)
    options = ServeOptions(root / "avatars", root / "data", api_keys=(KEY,), sessions_per_key=4,
                           live_capacity_fps=12.0, rtc_workers=1)
    service = Service(options, tiny_models).start()
    with in_thread(service) as url:  # the app's shutdown stops the service
        yield url, service


def _listed(url: str) -> list:
    return httpx.get(f"{url}/v1/sessions", headers={"Authorization": f"Bearer {KEY}"}).json()


async def _collect(session, items: list, until) -> None:
    """Items (with their arrival time) until `until(items)` holds or the stream ends."""
    async for item in session:
        items.append((time.monotonic(), item))
        if until(items):
            return


def _events(items, kind: str) -> list[SpeechEvent]:
    return [x for _, x in items if isinstance(x, SpeechEvent) and x.kind == kind]


def _after(items, kind: str) -> int:
    """How many items came after the first event of `kind` (-1: none yet)."""
    return next((len(items) - 1 - i for i, (_, x) in enumerate(items)
                 if isinstance(x, SpeechEvent) and x.kind == kind), -1)


def _rms(audio: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(audio, dtype=np.float64)))) if audio.size else 0.0


@pytest.mark.slow
def test_a_remote_session_plays_speaks_is_interrupted_and_frees_its_place(server):
    from lipstream.client import RemoteSession, connect

    url, _ = server
    speech = speech_like(1.5, 24_000, seed=1)
    stereo = np.stack([speech, speech * 0.5], axis=1).reshape(-1)  # interleaved, mixed down by the client
    long_speech = (speech_like(4.0, 16_000, seed=2) * 32767).astype(np.int16)

    async def run():
        session = await connect(url, "anna", api_key=KEY, fps=FPS, playout_delay_s=DELAY_S)
        assert isinstance(session, RemoteSession) and isinstance(session, SpeakingSession)
        assert session.fps == FPS and session.size == (320, 180)
        assert len(_listed(url)) == 1
        items: list = []
        await _collect(session, items, lambda xs: len(xs) >= 5)  # idle first
        for i in range(0, stereo.size, 2 * 2400):  # 100 ms chunks at 24 kHz stereo, in real time
            session.push_audio(stereo[i:i + 2 * 2400], 24_000, channels=2)
            await asyncio.sleep(0.1)
        session.end_utterance()
        await asyncio.wait_for(_collect(session, items, lambda xs: _after(xs, "finished") >= 3), 20)
        first_part = len(items)
        session.push_audio(long_speech.tobytes(), 16_000)  # PCM16 bytes, cut off after ~0.6 s of playing
        await asyncio.wait_for(_collect(session, items, lambda xs: len(_events(xs, "started")) == 2), 20)
        await asyncio.sleep(0.6)
        session.clear()
        await asyncio.wait_for(_collect(session, items, lambda xs: _events(xs, "interrupted") and
                                        isinstance(xs[-1][1], LiveFrame) and xs[-1][1].frame >=
                                        _events(xs, "interrupted")[0].frame + 3), 20)
        picture = session.rgb(next(x for _, x in items if isinstance(x, LiveFrame)))
        session.close()  # the sync call, from the event loop: the DELETE is scheduled
        session.close()  # idempotent
        rest = [x async for x in session]  # iteration has stopped
        await session.aclose()
        return items, first_part, picture, rest

    items, first_part, picture, rest = asyncio.run(run())
    assert rest == [] and _listed(url) == []  # its place is free
    print("frames (index, late, utterance):", [(x.frame, int(x.late), x.utterance) for _, x in items
                                               if isinstance(x, LiveFrame)])
    frames = [(at, x) for at, x in items if isinstance(x, LiveFrame)]
    indexes = [x.frame for _, x in frames]
    assert indexes == list(range(indexes[0], indexes[0] + len(indexes))), indexes  # consecutive, none twice
    assert all(x.fps == FPS and x.i420.shape == (270, 320) and x.audio.size == 9600 for _, x in frames)  # 48 kHz / 5
    span = frames[-1][0] - frames[0][0]
    assert 0.6 < span / ((len(frames) - 1) / float(FPS)) < 1.5, (span, len(frames))  # at the session's rate
    assert picture.shape == (180, 320, 3) and picture.dtype == np.uint8

    # the first utterance: its events bracket exactly the frames that speak it, in a local session's order
    first = [(i, x) for i, (_, x) in enumerate(items[:first_part])]
    started, done = _events(items, "started")[0], _events(items, "finished")[0]
    assert started.utterance == done.utterance
    speaking = [(i, x) for i, x in first if isinstance(x, LiveFrame) and x.utterance == started.utterance]
    assert [x.frame for _, x in speaking] == list(range(started.frame, done.frame + 1))
    assert 6 <= len(speaking) <= 9, len(speaking)  # 1.5 s at 5 fps
    at = {id(x): i for i, x in first}
    assert at[id(started)] < speaking[0][0] and at[id(done)] > speaking[-1][0]
    # picture and sound in step: the speaking frames carry the speech, the idle ones before it silence
    idle = [x for _, x in first if isinstance(x, LiveFrame) and x.frame < started.frame]
    assert idle and max(_rms(x.audio) for x in idle) < 0.01
    loud = [_rms(x.audio) for _, x in speaking]
    assert sum(r > 0.02 for r in loud) >= len(loud) - 1, loud

    # the second, interrupted: after the interrupt's frame every frame is idle
    cut = _events(items, "interrupted")
    assert len(cut) == 1 and cut[0].utterance == _events(items, "started")[1].utterance
    after = [x for _, x in frames if x.frame >= cut[0].frame]
    assert len(after) >= 3 and all(x.utterance is None for x in after)
    assert any(x.utterance == cut[0].utterance for _, x in frames)  # it did speak before the cut


@pytest.mark.slow
def test_a_remote_session_cuts_to_another_camera_mid_utterance(server):
    """The cut goes up the speech socket in order with the speech: the server answers with the frame it
    lands on, the pictures change there, and the utterance plays on across it, no frame missing."""
    from lipstream.client import connect

    url, service = server
    speech = speech_like(3.0, 16_000, seed=6)

    async def run():
        session = await connect(url, "anna", api_key=KEY, fps=FPS, playout_delay_s=DELAY_S)
        items: list = []
        try:
            reader = asyncio.ensure_future(_collect(session, items, lambda xs: _after(xs, "finished") >= 2))
            await asyncio.sleep(0.5)
            session.switch("cara")  # another frame size: refused, the session plays on
            for i in range(0, speech.size, 1600):  # 100 ms chunks in real time; the cut 1 s in
                session.push_audio(speech[i:i + 1600], 16_000)
                if i == 16_000:
                    session.switch("ben")
                await asyncio.sleep(0.1)
            session.end_utterance()
            await asyncio.wait_for(reader, 20)
            listed = _listed(url)
            return items, list(session.cuts), listed
        finally:
            await session.aclose()

    items, cuts, listed = asyncio.run(run())
    assert [c["type"] for c in cuts] == ["switch_refused", "switched"], cuts
    assert "'cara' is 480x270; a cut keeps the session's frame size, 320x180" in cuts[0]["message"]
    assert listed[0]["avatar"] == "ben"
    cut = cuts[1]["frame"]
    frames = [x for _, x in items if isinstance(x, LiveFrame)]
    assert [x.frame for x in frames] == list(range(frames[0].frame, frames[-1].frame + 1))  # no gap
    started, done = _events(items, "started")[0], _events(items, "finished")[0]
    assert started.frame < cut < done.frame
    # the speech went on across the cut: each frame loud where the speech is (it pauses 1.4-1.8 s in)
    heard = [_rms(x.audio) > 0.02 for x in frames if started.frame <= x.frame <= done.frame]
    said = [_rms(speech[i:i + 3200]) > 0.02 for i in range(0, speech.size, 3200)]
    assert sum(h != s for h, s in zip(heard, said)) <= 1 and len(heard) == len(said), (heard, said)

    loops = {name: service.live.engine.avatars[service.avatars[name]].frames[:, :16].float().numpy()
             for name in ("anna", "ben")}

    def nearest(frame: LiveFrame) -> str:  # H.264 is lossy: the avatar whose loop frames are nearest
        rows = frame.i420[:16].astype(np.float32)
        return min(loops, key=lambda name: np.abs(loops[name] - rows).mean(axis=(1, 2)).min())

    shown = [nearest(x) for x in frames if not x.late]
    expected = ["anna" if x.frame < cut else "ben" for x in frames if not x.late]
    assert shown == expected, (cut, [x.frame for x in frames], shown)


@pytest.mark.slow
def test_a_low_latency_session_is_a_choice_of_the_client(server):
    from lipstream.client import SessionRefused, connect

    url, _ = server

    async def run():
        session = await connect(url, "anna", api_key=KEY, fps=FPS, latency="low", playout_delay_s=DELAY_S)
        try:
            status = httpx.get(f"{url}/v1/sessions/{session.id}", headers={"Authorization": f"Bearer {KEY}"}).json()
        finally:
            await session.aclose()
        with pytest.raises(SessionRefused) as e:
            await connect(url, "anna", api_key=KEY, latency="fast")
        return status, e.value

    status, refused = asyncio.run(run())
    assert status["window_ahead_ms"] == 40 and status["playout_delay_ms"] == DELAY_S * 1000
    assert refused.status == 422 and "latency: 'fast'; 'default' or 'low' is allowed" in str(refused)
    assert _listed(url) == []


def test_pictures_at_a_size_asked_for(server):
    from lipstream.client import connect

    url, _ = server

    async def run():
        async with await connect(url, "anna", api_key=KEY, fps=FPS, size=(160, 90)) as session:
            assert session.size == (160, 90)
            frame = await asyncio.wait_for(anext(x async for x in session if isinstance(x, LiveFrame)), 20)
            return frame, session.rgb(frame), session.rgb(frame, (64, 36), "RGBA")

    frame, rgb, small = asyncio.run(run())
    assert frame.i420.shape == (135, 160) and rgb.shape == (90, 160, 3) and small.shape == (36, 64, 4)
    assert _listed(url) == []


def test_a_refused_session_raises_one_clear_error_and_leaves_nothing_open(server):
    from lipstream.client import SessionRefused, connect

    url, service = server

    async def refused(**kw) -> str:
        with pytest.raises(SessionRefused) as e:
            await connect(url, kw.pop("avatar", "anna"), **kw)
        return str(e.value)

    async def run():
        messages = [await refused(avatar="bob", api_key=KEY), await refused(api_key="wrong-key-0123456789"),
                    await refused()]
        held = [await connect(url, "anna", api_key=KEY, fps=FPS) for _ in range(2)]
        messages.append(await refused(api_key=KEY, fps=FPS))  # 12 frames/s: a third 5 fps session is too many
        for s in held:
            await s.aclose()
        with pytest.raises(SessionRefused) as e:
            await connect("http://127.0.0.1:9", "anna")  # nothing listens there
        return messages + [str(e.value)]

    bad_avatar, bad_key, no_key, full, unreachable = asyncio.run(run())
    assert bad_avatar.startswith(url) and "'bob' is not resident" in bad_avatar and "anna" in bad_avatar
    assert bad_key == f"{url} answered 401: it refused the API key given (not one of its keys): pass api_key=KEY"
    assert no_key == f"{url} answered 401: it wants an API key: pass api_key=KEY"
    assert full.startswith(url) and "(503)" in full and "full" in full, full
    assert unreachable.startswith("http://127.0.0.1:9") and "cannot be reached" in unreachable
    assert all("\n" not in m for m in (bad_avatar, bad_key, no_key, full, unreachable))
    assert _listed(url) == [] and not service.sessions.open


def test_the_client_imports_without_torch():
    code = "import sys, lipstream.client; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={"PYTHONPATH": SRC, "PATH": ""})
