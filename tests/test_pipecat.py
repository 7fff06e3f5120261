"""The Pipecat video service on the CPU (tiny networks), through Pipecat's own test pipeline (`run_test`)
and one real SmallWebRTC transport to an aiortc client on loopback.

Sessions run at 4 fps with a 2 s playout delay (the tiny networks take ~0.1 s a frame on 2 cores);
what is under test (a picture per frame, its audio after it, the stop after the last audio, the
interrupt, two pipelines on one engine) is the same at 25 fps on a GPU. Each picture carries its
frame index in its metadata, so a lost or doubled frame shows.
"""

from __future__ import annotations

import asyncio
import functools
import time
from fractions import Fraction

import numpy as np
import pytest
import torch

pytest.importorskip("pipecat")

from pipecat.frames.frames import (  # noqa: E402
    EndFrame,
    ErrorFrame,
    InterruptionFrame,
    OutputImageRawFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
)
from pipecat.observers.base_observer import BaseObserver, FramePushed  # noqa: E402
from pipecat.processors.frame_processor import FrameDirection  # noqa: E402
from pipecat.tests.utils import SleepFrame, run_test  # noqa: E402

from lipstream.audio.resample import resample  # noqa: E402
from lipstream.audio.windows import num_frames  # noqa: E402
from lipstream.fixtures import speech_like  # noqa: E402
from lipstream.fixtures.avatar import tracked_avatar  # noqa: E402
from lipstream.integrations.pipecat import (  # noqa: E402
    FRAME_KEY, UTTERANCE_KEY, AvatarSwitchFrame, LipStreamVideoService)
from lipstream.live import SessionRefused, LiveEngine, LiveOptions  # noqa: E402
from lipstream.media.pixels import mono_pcm  # noqa: E402
from lipstream.media.rates import AUDIO_RATE  # noqa: E402

pytestmark = pytest.mark.slow  # Pipecat pipelines (its extra) run in real time: `make test` only

FPS = Fraction(4)
DELAY_S = 2.0
PER_FRAME = AUDIO_RATE // 4  # 48 kHz samples a frame at 4 fps
SIZE = (320, 180)


@pytest.fixture(scope="module")
def avatar(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("pipecat")
    tracked_avatar(root, "ben", tiny_models.vae, tiny_models.fingerprints["vae"], width=SIZE[0], height=SIZE[1],
                   seed=5)  # a second camera of the same frame size (camera cuts)
    return tracked_avatar(root, "anna", tiny_models.vae, tiny_models.fingerprints["vae"], width=SIZE[0],
                          height=SIZE[1], seed=0)


@pytest.fixture(scope="module")
def engine(tiny_models, avatar):
    # capacity given, not measured (a loaded 2-core machine would refuse sessions); idle loop kept
    live = LiveEngine(tiny_models, LiveOptions(playout_delay_s=DELAY_S, buckets=(1, 2, 4, 8), encode=False,
                                               max_sessions=8, capacity_fps=100.0, idle_cache_gib=1.0))
    live.add_avatar(avatar)
    live.add_avatar(avatar.parent / "ben")
    live.start()
    yield live
    live.close()


class Pushed(BaseObserver):
    """What one processor pushed downstream, with the time (time.monotonic()) it pushed it."""

    def __init__(self, source):
        super().__init__()
        self.source, self.items = source, []

    async def on_push_frame(self, data: FramePushed):
        if data.source is self.source and data.direction == FrameDirection.DOWNSTREAM:
            self.items.append((time.monotonic(), data.frame))


def _sync(test):
    """An async test run on its own event loop (no pytest-asyncio here)."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))
    return run


def _pcm16(x: np.ndarray) -> np.ndarray:
    return (np.clip(x, -1, 1) * 32767).round().astype(np.int16)


def _tts(pcm: np.ndarray, rate: int, channels: int = 1, chunk_s: float = 0.02) -> list:
    """A TTS response: started, the audio in 20 ms TTSAudioRawFrames (int16, interleaved), stopped."""
    step = round(rate * chunk_s) * channels
    chunks = [TTSAudioRawFrame(audio=pcm[i:i + step].tobytes(), sample_rate=rate, num_channels=channels)
              for i in range(0, pcm.size, step)]
    return [TTSStartedFrame(), *chunks, TTSStoppedFrame()]


def _service(engine, **kw) -> LipStreamVideoService:
    return LipStreamVideoService(engine=engine, avatar="anna", fps=FPS, **kw)


def _expected48(pcm: np.ndarray, rate: int, channels: int = 1) -> np.ndarray:
    """What the session should speak: the input mixed down as the session mixes it, at 48 kHz."""
    mono = mono_pcm(pcm, channels).astype(np.float32) / 32768.0
    return resample(torch.from_numpy(mono), rate, AUDIO_RATE).numpy()


def _speech_images(down: list) -> list[OutputImageRawFrame]:
    return [f for f in down if isinstance(f, OutputImageRawFrame) and f.metadata[UTTERANCE_KEY] is not None]


def _check_frames_follow(down: list) -> None:
    """Every picture of the run, frame by frame (none lost or doubled), each speech picture followed by its audio."""
    images = [f for f in down if isinstance(f, OutputImageRawFrame)]
    assert images, "no pictures"
    index = [f.metadata[FRAME_KEY] for f in images]
    assert index == list(range(index[0], index[0] + len(index)))
    for k, f in enumerate(down):
        if isinstance(f, OutputImageRawFrame):
            assert f.size == SIZE and f.format == "RGB" and len(f.image) == SIZE[0] * SIZE[1] * 3
            assert f.sync_with_audio
            if f.metadata[UTTERANCE_KEY] is not None:
                audio = down[k + 1]
                assert isinstance(audio, TTSAudioRawFrame), f"speech picture {f.metadata[FRAME_KEY]} without its audio"
                assert audio.sample_rate == AUDIO_RATE and audio.num_channels == 1
                assert len(audio.audio) == 2 * PER_FRAME
        elif isinstance(f, TTSAudioRawFrame):
            before = down[k - 1]
            assert isinstance(before, OutputImageRawFrame) and before.metadata[UTTERANCE_KEY] is not None


def _spoken(down: list) -> np.ndarray:
    """The audio out, as float, in order."""
    audio = [np.frombuffer(f.audio, np.int16) for f in down if isinstance(f, TTSAudioRawFrame)]
    return np.concatenate(audio).astype(np.float32) / 32767.0 if audio else np.zeros(0, np.float32)


def _assert_speaks(down: list, expected: np.ndarray) -> None:
    got = _spoken(down)
    assert got.size >= expected.size and got.size - expected.size < PER_FRAME
    np.testing.assert_allclose(got[:expected.size], expected, atol=2e-4)
    assert not got[expected.size:].any()  # the last frame's audio past the speech is silence


def test_bad_arguments_are_one_line_errors(engine):
    with pytest.raises(ValueError, match="engine, url"):
        LipStreamVideoService(avatar="anna")
    with pytest.raises(ValueError, match="engine, url"):
        LipStreamVideoService(engine=engine, url="http://localhost:8000", avatar="anna")
    with pytest.raises(ValueError, match="api_key"):
        LipStreamVideoService(engine=engine, avatar="anna", api_key="k")
    with pytest.raises(ValueError, match="size"):
        LipStreamVideoService(engine=engine, avatar="anna", size=(320,))
    with pytest.raises(ValueError, match="fps"):
        LipStreamVideoService(engine=engine, avatar="anna", fps=0)
    with pytest.raises(ValueError, match="playout_delay_s"):
        LipStreamVideoService(engine=engine, avatar="anna", playout_delay_s=9)
    with pytest.raises(ValueError, match="url"):
        LipStreamVideoService(url="localhost:8000", avatar="anna")
    with pytest.raises(ValueError, match="avatar"):
        LipStreamVideoService(url="http://localhost:8000", avatar=0)


@_sync
async def test_a_picture_per_frame_of_speech_and_the_stop_after_the_last_audio(engine):
    pcm = _pcm16(speech_like(2.0, 16_000, seed=1))
    service = _service(engine)
    seen = Pushed(service)
    down, _ = await run_test(service, frames_to_send=_tts(pcm, 16_000), observers=[seen])
    _check_frames_follow(down)
    speech = _speech_images(down)
    assert len(speech) == num_frames(pcm.size, FPS)  # 2 s at 4 fps: 8 pictures, each once
    assert len({f.metadata[UTTERANCE_KEY] for f in speech}) == 1
    # they went out at the session's frame rate
    times = [t for t, f in seen.items if isinstance(f, OutputImageRawFrame) and f.metadata[UTTERANCE_KEY] is not None]
    intervals = np.diff(times)
    assert abs(np.median(intervals) - 1 / FPS) < 0.05
    assert times[-1] - times[0] == pytest.approx((len(times) - 1) / FPS, abs=0.3)
    # TTSStarted passes on; TTSStopped comes right after the utterance's last audio
    kinds = [type(f) for f in down]
    assert kinds.count(TTSStartedFrame) == 1 and kinds.count(TTSStoppedFrame) == 1
    stop = kinds.index(TTSStoppedFrame)
    last_audio = max(k for k, f in enumerate(down) if isinstance(f, TTSAudioRawFrame))
    assert stop == last_audio + 1
    assert kinds.index(TTSStartedFrame) < kinds.index(TTSAudioRawFrame)
    _assert_speaks(down, _expected48(pcm, 16_000))


@_sync
async def test_each_picture_has_its_own_audio_stereo_44k_mixed_down(engine):
    pcm = _pcm16(np.stack([speech_like(1.5, 44_100, seed=2), 0.3 * speech_like(1.5, 44_100, seed=3)], 1).reshape(-1))
    down, _ = await run_test(_service(engine), frames_to_send=_tts(pcm, 44_100, channels=2))
    _check_frames_follow(down)
    expected = _expected48(pcm, 44_100, channels=2)
    expected = np.pad(expected, (0, -expected.size % PER_FRAME))
    speech = _speech_images(down)
    assert len(speech) == expected.size // PER_FRAME
    start = speech[0].metadata[FRAME_KEY]
    for k, f in enumerate(down):  # frame f's audio is samples [f - start, f - start + 1) frames of the speech
        if isinstance(f, OutputImageRawFrame) and f.metadata[UTTERANCE_KEY] is not None:
            local = f.metadata[FRAME_KEY] - start
            got = np.frombuffer(down[k + 1].audio, np.int16).astype(np.float32) / 32767.0
            np.testing.assert_allclose(got, expected[local * PER_FRAME:(local + 1) * PER_FRAME], atol=2e-4)


@_sync
async def test_interruption_goes_idle_within_a_frame(engine):
    pcm = _pcm16(speech_like(4.0, 24_000, seed=4))
    service = _service(engine)
    seen = Pushed(service)
    frames = [*_tts(pcm, 24_000), SleepFrame(DELAY_S + 1.2), InterruptionFrame(), SleepFrame(1.5)]
    down, _ = await run_test(service, frames_to_send=frames, observers=[seen])
    at = next(k for k, (_, f) in enumerate(seen.items) if isinstance(f, InterruptionFrame))
    before, after = seen.items[:at], seen.items[at + 1:]
    assert any(isinstance(f, TTSAudioRawFrame) for _, f in before)  # it was speaking
    assert not any(isinstance(f, TTSAudioRawFrame) for _, f in after)
    idle = [(t, f) for t, f in after if isinstance(f, OutputImageRawFrame)]
    assert idle and all(f.metadata[UTTERANCE_KEY] is None for _, f in idle)
    assert idle[0][0] - seen.items[at][0] <= 1 / FPS + 0.15  # the next picture is idle, within one frame
    assert len(idle) >= 4  # and idle pictures keep coming
    assert any(isinstance(f, InterruptionFrame) for f in down)
    assert sum(isinstance(f, TTSStoppedFrame) for f in down) == 1  # the held stop is let go, not lost
    frames_out = [f.metadata[FRAME_KEY] for f in down if isinstance(f, OutputImageRawFrame)]
    assert frames_out == sorted(set(frames_out))


@_sync
async def test_idle_pictures_keep_coming_without_audio(engine):
    service = _service(engine)
    seen = Pushed(service)
    down, _ = await run_test(service, frames_to_send=[SleepFrame(DELAY_S + 2.5)], observers=[seen])
    images = [(t, f) for t, f in seen.items if isinstance(f, OutputImageRawFrame)]
    assert not any(isinstance(f, TTSAudioRawFrame) for f in down)
    assert all(f.metadata[UTTERANCE_KEY] is None for _, f in images)
    _check_frames_follow(down)
    assert 8 <= len(images) <= 12  # 2.5 s at 4 fps once the first frame's playout time came
    assert abs(np.median(np.diff([t for t, _ in images])) - 1 / FPS) < 0.05


@_sync
async def test_two_pipelines_on_one_engine_do_not_cross(engine):
    a = _pcm16(speech_like(1.5, 16_000, seed=5))
    b = _pcm16(0.5 * speech_like(2.0, 22_050, seed=6))
    (down_a, _), (down_b, _) = await asyncio.gather(run_test(_service(engine), frames_to_send=_tts(a, 16_000)),
                                                    run_test(_service(engine), frames_to_send=_tts(b, 22_050)))
    for down, pcm, rate in ((down_a, a, 16_000), (down_b, b, 22_050)):
        _check_frames_follow(down)
        assert len(_speech_images(down)) == num_frames(round(pcm.size * 16_000 / rate), FPS)
        _assert_speaks(down, _expected48(pcm, rate))


@_sync
async def test_a_full_engine_is_a_pipecat_error_and_speech_passes_through(engine):
    held = []
    try:
        while True:  # fill every place
            held.append(engine.open_session("anna", fps=FPS, encode=False))
    except SessionRefused:
        pass
    try:
        pcm = _pcm16(speech_like(0.5, 16_000, seed=7))
        frames = _tts(pcm, 16_000)
        down, up = await run_test(_service(engine), frames_to_send=frames)
    finally:
        for s in held:
            s.close()
    errors = [f for f in up if isinstance(f, ErrorFrame)]
    assert len(errors) == 1 and "SessionRefused" in errors[0].error
    assert not any(isinstance(f, OutputImageRawFrame) for f in down)
    assert [type(f) for f in down] == [type(f) for f in frames]  # unchanged, in order
    assert b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame)) == pcm.tobytes()


@_sync
async def test_a_switch_frame_cuts_to_another_camera_and_the_speech_goes_on(engine):
    """An AvatarSwitchFrame mid-response: the pictures change camera once, mid-speech, none lost or doubled,
    each with its audio, and the speech out is the speech in; a switch to an avatar not resident is one
    Pipecat error and changes nothing."""
    from lipstream.media.pixels import i420_to_rgb

    pcm = _pcm16(speech_like(3.0, 16_000, seed=8))
    tts = _tts(pcm, 16_000)
    half = len(tts) // 2
    frames = [*tts[:half], SleepFrame(1.0), AvatarSwitchFrame(avatar="ben"), *tts[half:],
              AvatarSwitchFrame(avatar="nobody"), SleepFrame(1.0)]
    down, up = await run_test(_service(engine), frames_to_send=frames)
    _check_frames_follow(down)
    _assert_speaks(down, _expected48(pcm, 16_000))
    errors = [f for f in up if isinstance(f, ErrorFrame)]
    assert len(errors) == 1 and "'nobody' is not resident" in errors[0].error
    loops = {name: np.stack([i420_to_rgb(x.numpy(), "bt601")[:12] for x in engine.engine.avatars[i].frames])
             for name, i in (("anna", 0), ("ben", 1))}

    def camera(image: OutputImageRawFrame) -> str:
        rows = np.frombuffer(image.image, np.uint8).reshape(SIZE[1], SIZE[0], 3)[:12].astype(np.int16)
        return min(loops, key=lambda name: np.abs(loops[name] - rows).mean(axis=(1, 2, 3)).min())

    images = [f for f in down if isinstance(f, OutputImageRawFrame)]
    shown = [camera(f) for f in images]
    first_ben = shown.index("ben")
    assert shown == ["anna"] * first_ben + ["ben"] * (len(shown) - first_ben), shown
    speaking = [f.metadata[UTTERANCE_KEY] is not None for f in images]
    assert speaking[first_ben - 1] and speaking[first_ben]  # the cut came mid-speech


def test_load_bench_two_pipelines_report(engine):
    from lipstream.bench.pipecat_load import run

    row = run(engine, "anna", n=2, seconds=3.0, fps=4)
    assert row["n"] == 2 and row["opened"] == 2 and row["errors"] == 0 and len(row["pipelines"]) == 2
    assert row["images"] > 0 and row["speech_images"] > 0 and row["audio_frames"] == row["speech_images"]
    assert row["misaligned"] == 0
    assert 0 < row["fps_min"] <= row["fps_median"] < 2 * 4
    assert row["interval_p99_ms"] > 0 and row["interval_max_ms"] >= row["interval_p99_ms"]
    assert row["late"] >= row["late_speech"] >= 0
    assert row["size"] == list(SIZE)


def _loopback_offer_answer():
    """An aiortc client that receives audio and video, and the bot's SmallWebRTCConnection answering its offer."""
    from aiortc import RTCPeerConnection, RTCSessionDescription
    from pipecat.transports.smallwebrtc.connection import SmallWebRTCConnection

    async def connect():
        client = RTCPeerConnection()
        client.addTransceiver("audio", direction="recvonly")
        client.addTransceiver("video", direction="recvonly")
        await client.setLocalDescription(await client.createOffer())  # gathers its (loopback) candidates
        bot = SmallWebRTCConnection()
        await bot.initialize(sdp=client.localDescription.sdp, type=client.localDescription.type)
        answer = bot.get_answer()
        await client.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type=answer["type"]))
        return client, bot

    return connect


@_sync
async def test_a_real_pipeline_through_smallwebrtc_to_an_aiortc_client(engine):
    pytest.importorskip("aiortc")
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.transports.base_transport import TransportParams
    from pipecat.transports.smallwebrtc.transport import SmallWebRTCTransport
    from pipecat.workers.runner import WorkerRunner

    client, bot = await _loopback_offer_answer()()
    video, audio = [], []  # (time, width, height), (time, rms)

    async def receive(track):
        try:
            while True:
                frame = await track.recv()
                if track.kind == "video":
                    video.append((time.monotonic(), frame.width, frame.height))
                else:
                    pcm = frame.to_ndarray().astype(np.float32) / 32768.0
                    audio.append((time.monotonic(), float(np.sqrt(np.mean(pcm ** 2)))))
        except Exception:  # noqa: BLE001 (the track ended)
            return

    readers = [asyncio.ensure_future(receive(t.receiver.track)) for t in client.getTransceivers()]
    transport = SmallWebRTCTransport(webrtc_connection=bot, params=TransportParams(
        audio_out_enabled=True, audio_out_sample_rate=AUDIO_RATE, video_out_enabled=True,
        video_out_width=SIZE[0], video_out_height=SIZE[1], video_out_framerate=int(FPS)))
    worker = PipelineWorker(Pipeline([_service(engine), transport.output()]),
                            params=PipelineParams(audio_out_sample_rate=AUDIO_RATE), cancel_on_idle_timeout=False)
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def on_started(worker, frame):
        started.set()

    pcm = _pcm16(speech_like(2.0, 16_000, seed=8))
    spoke_at = []

    async def drive():
        await asyncio.wait_for(started.wait(), 30)
        await asyncio.sleep(1.0)  # connected, idle pictures flowing
        spoke_at.append(time.monotonic() + DELAY_S)  # the speech plays from here
        for f in _tts(pcm, 16_000):
            await worker.queue_frame(f)
        await asyncio.sleep(DELAY_S + 2.5)
        await worker.queue_frame(EndFrame())

    runner = WorkerRunner()
    await runner.add_workers(worker)
    try:
        await asyncio.wait_for(asyncio.gather(runner.run(), drive()), 60)
    finally:
        await client.close()
        for r in readers:
            r.cancel()
    assert len(video) >= 4 and all((w, h) == SIZE for _, w, h in video)
    during = [rms for t, rms in audio if spoke_at[0] + 0.2 <= t <= spoke_at[0] + 1.8]
    before = [rms for t, rms in audio if t < spoke_at[0] - 0.5]
    # the speech is heard: its syllables (about half of each 250 ms) carry energy, its gaps are silent
    assert during and max(during) > 0.05 and np.mean(np.array(during) > 0.01) > 0.25
    assert before and max(before) < 1e-3  # silence while idle


def _example():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "pipecat_bot.py"
    spec = importlib.util.spec_from_file_location("pipecat_bot", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return path, module


def test_example_bot_refuses_a_missing_avatar_in_one_line(tmp_path):
    import subprocess
    import sys

    path, _ = _example()
    r = subprocess.run([sys.executable, str(path), "--avatar", str(tmp_path / "nobody")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "--avatar" in r.stderr and "nobody" in r.stderr


@_sync
async def test_example_bot_serves_its_page_and_answers_an_offer_with_the_avatar(engine):
    import httpx
    from aiortc import RTCPeerConnection, RTCSessionDescription

    _, bot = _example()
    app = bot.build_app(engine, "anna", _pcm16(speech_like(1.0, 16_000, seed=9)), 16_000, fps=FPS, pause_s=0.5)
    client = RTCPeerConnection()
    client.addTransceiver("audio", direction="recvonly")
    client.addTransceiver("video", direction="recvonly")
    video = []

    @client.on("track")
    def on_track(track):
        async def read():
            while len(video) < 3 and track.kind == "video":
                frame = await track.recv()
                video.append((frame.width, frame.height))
        asyncio.ensure_future(read())

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bot") as http:
        page = await http.get("/")
        assert page.status_code == 200 and "RTCPeerConnection" in page.text and "/api/offer" in page.text
        assert (await http.post("/api/offer", json={"type": "answer"})).status_code == 400
        await client.setLocalDescription(await client.createOffer())
        r = await http.post("/api/offer", json={"sdp": client.localDescription.sdp, "type": "offer"})
        assert r.status_code == 200 and r.json()["type"] == "answer"
        await client.setRemoteDescription(RTCSessionDescription(sdp=r.json()["sdp"], type="answer"))
        deadline = time.monotonic() + DELAY_S + 10
        while len(video) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    await client.close()  # the bot sees its client leave and ends its pipeline
    for task in list(app.state.bots):
        await asyncio.wait_for(task, 10)
    assert len(video) >= 3 and all(v == SIZE for v in video)


REMOTE_FPS = Fraction(5)
REMOTE_KEY = "pipecat-key-0123456789abcdef"


@pytest.fixture(scope="module")
def server(tiny_models, avatar):
    """A real `lipstream serve` (Service behind uvicorn) on loopback, serving the same avatar."""
    from lipstream.serve.options import ServeOptions
    from lipstream.serve.server import in_thread
    from lipstream.serve.service import Service

    options = ServeOptions(avatar.parent, avatar.parent.parent / "serve-data", api_keys=(REMOTE_KEY,),
                           sessions_per_key=4, live_capacity_fps=12.0, rtc_workers=1)
    service = Service(options, tiny_models).start()
    with in_thread(service) as url:
        yield url


@_sync
async def test_url_mode_speaks_through_a_running_server(server):
    """`url=`: the same service on a `lipstream serve` session (lipstream.client over WebRTC): a picture per
    frame of speech, each followed by its own audio (Opus there and back: its energy, not its samples), the
    stop after the last audio, and the server's session closed at the end."""
    import httpx

    pcm = _pcm16(speech_like(2.0, 24_000, seed=5))
    service = LipStreamVideoService(url=server, avatar="anna", api_key=REMOTE_KEY, fps=REMOTE_FPS,
                                    playout_delay_s=1.5)
    down, _ = await run_test(service, frames_to_send=[SleepFrame(sleep=0.5), *_tts(pcm, 24_000)],
                             start_timeout=30.0)
    per_frame = AUDIO_RATE // int(REMOTE_FPS)
    images = [f for f in down if isinstance(f, OutputImageRawFrame)]
    assert images and all(f.size == SIZE and len(f.image) == SIZE[0] * SIZE[1] * 3 for f in images)
    speech = _speech_images(down)
    assert len(speech) == num_frames(pcm.size * 16_000 // 24_000, REMOTE_FPS)  # 2 s at 5 fps: 10
    index = [f.metadata[FRAME_KEY] for f in speech]
    assert index == list(range(index[0], index[0] + len(index)))
    for k, f in enumerate(down):
        if isinstance(f, OutputImageRawFrame) and f.metadata[UTTERANCE_KEY] is not None:
            audio = down[k + 1]
            assert isinstance(audio, TTSAudioRawFrame) and len(audio.audio) == 2 * per_frame
    spoken = _spoken(down)
    expected = _expected48(pcm, 24_000)
    assert abs(spoken.size - expected.size) < per_frame
    rms = lambda x: float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))  # noqa: E731
    assert rms(spoken) > 0.3 * rms(expected)
    kinds = [type(f) for f in down]
    last_audio = max(k for k, f in enumerate(down) if isinstance(f, TTSAudioRawFrame))
    assert kinds.index(TTSStoppedFrame) == last_audio + 1
    listed = httpx.get(f"{server}/v1/sessions", headers={"Authorization": f"Bearer {REMOTE_KEY}"}).json()
    assert listed == [] or listed.get("sessions", []) == []


def test_load_bench_against_a_server(server):
    """bench/pipecat_load.py with `url`: the pipelines in this process, the engine in `lipstream serve`."""
    from lipstream.bench.pipecat_load import run

    row = run(None, "anna", 1, 3.0, fps=REMOTE_FPS, playout_delay_s=1.5, url=server, api_key=REMOTE_KEY)
    assert row["opened"] == 1 and row["errors"] == 0, row["first_error"]
    assert row["images"] >= 10 and row["speech_images"] > 0 and row["misaligned"] == 0
    assert row["audio_frames"] == row["speech_images"]


def test_bots_in_processes_of_their_own_through_a_transport_against_a_server(server):
    """bench/pipecat_load.py's `bots`: a process per bot against one `lipstream serve`, each pipeline's output
    through SmallWebRTC to a viewer of its own: every bot opened, its pictures reached its viewer, each
    speech picture with its audio (the path the GPU figure takes, forced here on 2 cores)."""
    from lipstream.bench.pipecat_load import bots

    row = bots(server, "anna", 2, 4.0, SIZE, fps=REMOTE_FPS, api_key=REMOTE_KEY, playout_delay_s=1.5)
    assert row["processes"] == 2 and row["processes_failed"] == 0, row["first_failure"]
    assert row["opened"] == 2 and row["errors"] == 0, row["first_error"]
    assert row["speech_images"] > 0 and row["misaligned"] == 0 and row["audio_frames"] == row["speech_images"]
    assert row["fps_min"] > 0 and row["client_fps_min"] > 0
    assert all(p["client_images"] > 5 and p["client_audio_frames"] > 50 for p in row["pipelines"]), row["pipelines"]
    # the transport's own draws are counted beside what the viewer got: a viewer cannot get more than was drawn
    assert 0 < row["transport_fps_min"] and 0 < row["client_share_min"] <= 1.05, row
    # what the bots cost the machine they share with the server: each process's own cores, the machine's
    assert 0 < row["process_cores_median"] <= row["process_cores_sum"] <= row["host_busy_cores"] + 0.5, row
    assert row["host_busy_cores"] <= row["host_cores"] + 0.5, row
    print("bots:", {k: row[k] for k in ("fps_min", "transport_fps_min", "client_fps_min", "client_share_min",
                                        "process_cores_sum", "host_busy_cores")})
