"""The live session API the integrations build on (docs/live.md), on the CPU.

What an adapter relies on: PCM16 bytes and interleaved channels pushed as they come from a TTS,
pictures in the avatar's colour matrix, sessions opened by avatar name, and close() giving the
engine its place back.
"""

from __future__ import annotations

import asyncio
from fractions import Fraction

import numpy as np
import pytest
import torch

from lipstream.audio.resample import resample
from lipstream.avatar.colour import i420_to_rgb as i420_to_rgb_torch
from lipstream.fixtures import speech_like
from lipstream.fixtures.avatar import tracked_avatar
from lipstream.live import SessionRefused, LiveFrame, LiveOptions, SpeakingSession, SpeechEvent, start_engine
from lipstream.media.pixels import i420_to_rgb, mono_pcm, pcm16

FPS = Fraction(4)


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("api")
    folder = tracked_avatar(root, "anna", tiny_models.vae, tiny_models.fingerprints["vae"], width=320, height=180)
    options = LiveOptions(playout_delay_s=3.0, buckets=(1, 2, 4), encode=False, max_sessions=2,
                          capacity_fps=100.0, idle_cache_gib=1.0)
    live = start_engine([folder], random_weights=True, size="tiny", device="cpu", options=options)
    yield live
    live.close()


def test_mono_pcm_mixes_interleaved_channels():
    stereo = np.array([[100, 300], [-50, 50], [7, 8]], np.int16)
    assert mono_pcm(stereo.tobytes(), 2).tolist() == [200, 0, 8]  # rounded to even, as numpy rounds
    assert mono_pcm(np.array([0.5, -0.5, 0.25, 0.25], np.float32), 2).tolist() == [0.0, 0.25]
    with pytest.raises(ValueError, match="channels"):
        mono_pcm(b"\x00\x00" * 3, 2)
    assert np.frombuffer(pcm16(np.array([1.5, -1.0, 0.5], np.float32)), "<i2").tolist() == [32767, -32767, 16384]


@pytest.mark.parametrize("matrix", ["bt601", "bt709"])
def test_rgb_pictures_match_the_torch_conversion(matrix):
    rng = np.random.default_rng(0)
    i420 = np.empty((270, 320), np.uint8)
    i420[:180] = rng.integers(16, 236, (180, 320))
    i420[180:225], i420[225:] = 90, 200  # flat U and V planes: the matrix alone, no upsampling difference
    ours = i420_to_rgb(i420, matrix).astype(int)
    reference = i420_to_rgb_torch(torch.from_numpy(i420), 180, 320, matrix).numpy().astype(int)
    assert ours.shape == (180, 320, 3)
    assert np.abs(ours - reference).max() <= 2
    assert i420_to_rgb(i420, matrix, (160, 90), "RGBA").shape == (90, 160, 4)
    with pytest.raises(ValueError, match="matrix"):
        i420_to_rgb(i420, "bt2020")


@pytest.mark.slow
def test_a_session_by_name_speaks_stereo_pcm16_bytes(engine):
    """24 kHz stereo PCM16 in 20 ms chunks, as a TTS hands it over: the frames' audio is that speech."""
    speech = speech_like(1.0, 24_000, seed=3)
    stereo = np.repeat((speech * 32767).round().astype(np.int16)[:, None], 2, axis=1)

    async def run() -> tuple[list[LiveFrame], list[SpeechEvent]]:
        frames, events = [], []
        with engine.open_session("anna", fps=FPS) as s:
            assert isinstance(s, SpeakingSession)
            step = 480
            for i in range(0, len(stereo), step):
                s.push_audio(stereo[i:i + step].tobytes(), 24_000, channels=2)
            s.end_utterance()
            async for item in s:
                (frames if isinstance(item, LiveFrame) else events).append(item)
                if events and events[-1].kind == "finished":
                    break
            picture = s.rgb(frames[-1], (160, 90))
            assert picture.shape == (90, 160, 3) and picture.dtype == np.uint8
        return frames, events

    frames, events = asyncio.run(run())
    spoken = [f for f in frames if f.utterance is not None]
    assert len(spoken) == 4  # 1 s at 4 fps
    assert [e.kind for e in events] == ["started", "finished"]
    out = np.concatenate([f.audio for f in spoken])
    expected = resample(torch.from_numpy(speech), 24_000, 48_000).numpy()
    n = min(out.size, expected.size)
    assert abs(out.size - expected.size) <= 48_000 // 25
    assert np.abs(out[:n] - expected[:n]).max() < 2e-3  # PCM16 quantisation, nothing else


def test_close_gives_the_engine_its_place_back(engine):
    first, second = engine.open_session("anna", fps=FPS), engine.open_session(0, fps=FPS)
    with pytest.raises(SessionRefused):
        engine.open_session(0, fps=FPS)
    second.close()
    second.close()  # idempotent
    assert second.closed
    third = engine.open_session(0, fps=FPS)

    async def ended() -> list:
        return [item async for item in second]  # a closed session's iteration stops

    assert asyncio.run(ended()) == []
    for s in (first, third):
        s.close()
    assert not engine.sessions
    with pytest.raises(ValueError, match="'bob' is not resident; resident: anna"):
        engine.open_session("bob")
    with pytest.raises(ValueError, match="channels"):
        engine.open_session(0, fps=FPS).push_audio(np.zeros((10, 3), np.float32), 16_000)
    for s in list(engine.sessions.values()):
        s.close()


def test_start_engine_names_a_folder_that_is_not_an_avatar(tmp_path):
    with pytest.raises(ValueError, match=f"avatars: {tmp_path} is not a compiled avatar folder"):
        start_engine([tmp_path], random_weights=True, size="tiny", device="cpu")


BLOCK_EXTRAS = """
import importlib.abc, sys
class NoExtras(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('pipecat', 'livekit'):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: the extras are not installed)")
sys.meta_path.insert(0, NoExtras())
"""


def test_the_core_package_needs_neither_extra():
    """`import lipstream` and everything but lipstream.integrations run without pipecat and livekit."""
    import subprocess
    import sys

    code = BLOCK_EXTRAS + """
import lipstream, lipstream.live, lipstream.render, lipstream.cli, lipstream.serve.app, lipstream.integrations
assert not [m for m in sys.modules if m.split('.')[0] in ('pipecat', 'livekit')]
from lipstream.cli import app
from typer.testing import CliRunner
result = CliRunner().invoke(app, ['--help'])
assert result.exit_code == 0, result.output
print('ok')
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
