"""Camera cuts in a live session (tiny networks on the CPU): another resident avatar of the same frame
size from the next frame not yet rendered, mid-utterance, with no gap in frames or audio."""

from __future__ import annotations

import asyncio
import time
from fractions import Fraction

import numpy as np
import pytest
import torch

from lipstream.audio.resample import resample
from lipstream.fixtures import speech_like
from lipstream.fixtures.avatar import tracked_avatar
from lipstream.fixtures.stream import nal_types
from lipstream.live import LiveEngine, LiveFrame, LiveOptions, SpeechEvent
from lipstream.media.rates import AUDIO_RATE

FPS = Fraction(4)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("cuts")
    made = [tracked_avatar(root, name, tiny_models.vae, tiny_models.fingerprints["vae"], width=w, height=h, seed=seed)
            for name, w, h, seed in (("wide", 320, 180, 0), ("close", 320, 180, 5), ("big", 480, 270, 1))]
    live = LiveEngine(tiny_models, LiveOptions(playout_delay_s=3.0, buckets=(1, 2, 4), encode=False, max_sessions=4,
                                               capacity_fps=100.0, idle_cache_gib=1.0))
    for folder in made:
        live.add_avatar(folder)
    with live.start():
        yield live


def _shows(live: LiveEngine, frame: LiveFrame) -> int:
    """Which resident avatar a frame's picture is of: its top rows (outside the face) equal one of its loop frames."""
    rows = frame.i420[:16]
    for index, a in enumerate(live.engine.avatars):
        loops = a.frames[:, :16].cpu().numpy() if a.frames.shape[-1] == rows.shape[-1] else None
        if loops is not None and any(np.array_equal(rows, x) for x in loops):
            return index
    raise AssertionError(f"frame {frame.frame} is none of the resident avatars' loop frames")


def test_a_cut_mid_utterance_changes_the_picture_at_its_frame_and_the_speech_goes_on(engine):
    """Speech pushed ahead is rendered ahead: a cut lands where speech pushed at that moment would
    (the playout delay ahead), and the frames from there on rendered with the avatar before are
    rendered again."""
    speech = speech_like(5.0, 16_000, seed=3)
    items, cut, ahead, stats = asyncio.run(_cut_mid_utterance(engine, speech, encode=False))
    assert cut < ahead  # frames of the old avatar had been rendered past it
    frames = [i for i in items if isinstance(i, LiveFrame)]
    assert [f.frame for f in frames] == list(range(frames[0].frame, frames[-1].frame + 1))  # no gap
    assert stats.late == 0 and stats.skipped == 0
    shows = [_shows(engine, f) for f in frames]
    assert shows == [0] * (cut - frames[0].frame) + [1] * (frames[-1].frame - cut + 1), (cut, shows)
    # the utterance goes on across the cut: every frame of it played, with its audio
    spoken = [f for f in frames if f.utterance is not None]
    assert {f.utterance for f in spoken} == {0}
    assert spoken[0].frame < cut < spoken[-1].frame
    heard = np.concatenate([f.audio for f in spoken])  # the speech pushed, sample for sample, across the cut
    expected = resample(torch.from_numpy(speech), 16_000, AUDIO_RATE).numpy()
    assert expected.size <= heard.size < expected.size + AUDIO_RATE / FPS
    np.testing.assert_allclose(heard[:expected.size], expected, atol=1e-4)


async def _cut_mid_utterance(engine, speech: np.ndarray, encode: bool):
    """A session on "wide" speaks `speech` pushed at once; once frames are rendered (and, with `encode`,
    encoded) ahead, a cut to "close". Its items until the utterance finished, the frame the cut landed on,
    the next frame to plan (with `encode`: to encode) before it."""
    s = engine.open_session("wide", fps=FPS, encode=encode)
    items: list = []
    try:
        s.push_audio(speech, 16_000)
        s.end_utterance()
        reader = asyncio.ensure_future(_read_until_finished(s, items))
        await _rendered_ahead(s, 3, encoded=encode)
        ahead = s.handoff._out_next if encode else s.request.next_frame
        cut = s.switch("close")
        assert s.avatar == 1
        await reader
        return items, cut, ahead, s.stats
    finally:
        engine.close_session(s)


async def _rendered_ahead(session, frames: int, encoded: bool = False) -> None:
    """Until the core has planned (`encoded`: the hand-off has sent to the encoder) `frames` past where speech
    pushed now would start (a loaded machine is slow)."""
    await asyncio.sleep(0.6)  # the speech has begun to play on the session's timeline (2 frames at 4 fps)
    until = time.monotonic() + 60  # a machine too loaded to get ahead at all fails here, saying so, not hangs
    while ((session.handoff._out_next if encoded else session.request.next_frame)
           < session.clock.media_frame(time.monotonic()) + frames):
        assert time.monotonic() < until, (
            f"{'encoded' if encoded else 'planned'} up to frame "
            f"{session.handoff._out_next if encoded else session.request.next_frame}, not {frames} frames past "
            f"{session.clock.media_frame(time.monotonic())} after 60 s", session.stats)
        await asyncio.sleep(0.05)


async def _read_until_finished(session, items: list) -> None:
    async for item in session:
        items.append(item)
        if isinstance(item, SpeechEvent) and item.kind == "finished":
            return


def test_a_cut_and_a_push_at_one_moment_land_on_the_same_frame(engine):
    speech = speech_like(0.5, 16_000, seed=4)

    async def run():
        s = engine.open_session("wide", fps=FPS)
        try:
            await asyncio.sleep(0.3)
            cut = s.switch("close")
            s.push_audio(speech, 16_000)
            s.end_utterance()
            async for item in s:
                if isinstance(item, SpeechEvent) and item.kind == "started":
                    return cut, item.frame
        finally:
            engine.close_session(s)

    cut, started = asyncio.run(run())
    assert started - 1 <= cut <= started  # the same frame, unless a frame boundary fell between the calls


def test_a_cut_to_another_frame_size_or_an_unknown_avatar_is_refused(engine):
    s = engine.open_session("wide", fps=FPS)
    try:
        with pytest.raises(ValueError, match="'big' is 480x270; a cut keeps the session's frame size, 320x180"):
            s.switch("big")
        with pytest.raises(ValueError, match="'nobody' is not resident; resident: wide, close, big"):
            s.switch("nobody")
        assert s.avatar == 0
        assert s.switch(0) >= 0  # back to the one it shows: allowed, nothing changes
    finally:
        engine.close_session(s)
    with pytest.raises(RuntimeError, match="is closed"):
        s.switch("close")


def test_an_encoded_session_cut_mid_utterance_is_one_decodable_stream(engine):
    """Frames already encoded past the cut with the avatar before are encoded again: an IDR at the cut, each
    frame's video once with rising timestamps, the audio on, the whole stream decodes, and its pictures
    change camera at the cut."""
    import av

    items, cut, ahead, _ = asyncio.run(_cut_mid_utterance(engine, speech_like(4.0, 16_000, seed=5), encode=True))
    assert cut < ahead  # frames past the cut had gone to the encoder
    frames = [i for i in items if isinstance(i, LiveFrame)]
    video = [p for f in frames for p in f.packets if p.kind == "video"]
    audio = [p for f in frames for p in f.packets if p.kind == "audio"]
    assert [p.pts for p in video] == list(range(video[0].pts, video[-1].pts + 1))  # each frame once, in order
    at_cut = next(p for p in video if p.pts == cut)
    assert at_cut.keyframe and 5 in nal_types(at_cut.data)
    assert all(b.pts > a.pts for a, b in zip(audio, audio[1:]))
    codec = av.CodecContext.create("h264", "r")
    decoded = [f for p in video for f in codec.decode(av.Packet(p.data))] + list(codec.decode(None))
    assert len(decoded) == len(video)
    # the pictures after the cut are the close-up's (lossy: near its loop frames, far from the wide one's)
    loops = [engine.engine.avatars[i].frames[:, :16].float().numpy() for i in (0, 1)]

    def camera(picture) -> int:  # lossy: the avatar whose loop frames are nearest
        rows = picture.to_ndarray(format="yuv420p")[:16].astype(np.float32)
        return int(np.argmin([np.abs(loop - rows).mean(axis=(1, 2)).min() for loop in loops]))

    assert [camera(d) for d in decoded] == [int(p.pts >= cut) for p in video]


def _request(options: LiveOptions):
    """A session's request on its own (no engine) at 25 fps, its timeline starting now."""
    from lipstream.live.features import FeatureTable
    from lipstream.live.items import SessionClock
    from lipstream.live.request import SpeechRequest

    table = FeatureTable(1, 256, torch.device("cpu"), torch.float32)
    clock = SessionClock(time.monotonic(), options.playout_delay_s, Fraction(25))
    return SpeechRequest(0, 0, 0, Fraction(25), 10, 0, clock, options, table), table


@pytest.mark.parametrize("ahead", [6, 2, 0])
def test_a_frame_waits_for_its_window_only_as_far_ahead_as_window_ahead_steps(ahead):
    """Frame f's window is steps 2f-4 .. 2f+5 at 25 fps; with `window_ahead_steps` = a it is rendered once
    steps up to 2f+a-1 are final, the steps not in yet read the last one that is; with 6 (the default)
    only once the whole window is in."""
    request, table = _request(LiveOptions(window_ahead_steps=ahead))
    request.push(np.zeros(16_000, np.float32), 16_000, request.clock.t0)  # 1 s, still open: frames 0-24
    u = request._utterances[0]
    u.final = 20  # features final for steps 0-19 (the audio's first 400 ms)
    frames, _ = request.candidates(request.clock.t0, 64, 0.0, 0)
    speaking = [c for c in frames if c.utterance is not None]
    # the last frame rendered: 2f + ahead <= 20 (ahead 6: its window's end, 2f + 6, is in)
    assert [c.frame for c in speaking] == list(range(0, (20 - ahead) // 2 + 1))
    last = speaking[-1]
    first = 2 * last.frame - 4
    expected = [table.row(0, k) if 0 <= k < 20 else (table.row(0, 19) if k >= 20 else table.zero)
                for k in range(first, first + 10)]
    assert last.rows == expected and not last.underrun


def test_a_low_latency_session_renders_a_frame_once_its_own_audio_is_in(engine):
    """Speech pushed in 20 ms chunks in real time: a default session's speech frame is planned once its
    window is in (120 ms past the frame's start, at every frame rate), a low-latency one's once the
    window's first 40 ms past the start are."""
    speech = speech_like(2.0, 16_000, seed=9)

    async def waits(latency):
        s = engine.open_session("wide", fps=FPS, latency=latency, playout_delay_s=3.0)
        items = []
        try:
            reader = asyncio.ensure_future(_read_until_finished(s, items))
            for i in range(0, speech.size, 320):
                s.push_audio(speech[i:i + 320], 16_000)
                await asyncio.sleep(0.02)
            s.end_utterance()
            await reader
        finally:
            engine.close_session(s)
        frames = [i for i in items if isinstance(i, LiveFrame) and i.utterance is not None and i.pushed_at]
        audio = [f.audio_at - f.pushed_at for f in frames[:-2]]  # the stage "audio": the window's part waited for
        return [f.planned_at - f.pushed_at for f in frames[:-2]], s.o, float(np.median(audio))

    default, default_o, default_audio = asyncio.run(waits(None))
    low, low_o, low_audio = asyncio.run(waits("low"))
    assert default_audio >= 0.12 and 0.04 <= low_audio <= 0.08, (default_audio, low_audio)
    assert (default_o.window_ahead_steps, low_o.window_ahead_steps) == (6, 2)
    assert low_o.playout_delay_s == 3.0  # its own delay goes over the preset's
    # the default waits for 120 ms of audio past the frame's start, low for 40 ms (each plus the chunk, the
    # Whisper window's 12.5 ms margin and the core's turn)
    assert min(default) >= 0.12 and min(low) >= 0.04, (default, low)
    assert float(np.median(low)) <= float(np.median(default)) - 0.06, (low, default)
    with pytest.raises(ValueError, match="latency: 'fast'; 'default' or 'low' is allowed"):
        engine.open_session("wide", latency="fast")
