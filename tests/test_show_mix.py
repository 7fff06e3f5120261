"""The music bed under the speech (show/mix.py), on real encoded files: levels in dB on the bed component
(the mix minus the speech), full scale, the gain curve's smoothness, loop/pad, the show fades, bad files."""

from __future__ import annotations

import numpy as np
import pytest

from lipstream.errors import InputError
from lipstream.fixtures.media import write_audio
from lipstream.show.mix import CEILING, duck_gain, load_music, mix_music
from lipstream.show.spec import Music

R = 48_000


def db(x: np.ndarray) -> float:
    return 20 * np.log10(np.sqrt(np.mean(np.square(x, dtype=np.float64))) + 1e-12)


def tones(seconds: float, amp: float, rate: int = R) -> np.ndarray:
    """A steady bed: two tones at a constant level."""
    t = np.arange(round(seconds * rate)) / rate
    return (amp * 0.5 * (np.sin(2 * np.pi * 220 * t) + np.sin(2 * np.pi * 330 * t + 1.0))).astype(np.float32)


def speech_like(seconds: float, phrases: list[tuple[float, float]], peak: float) -> np.ndarray:
    """Phrases of 0.25 s 'words' (a harmonic buzz with a syllable-rate envelope) and 0.1 s gaps between them,
    peaking at `peak`."""
    t = np.arange(round(seconds * R)) / R
    voice = sum(np.sin(2 * np.pi * 140 * k * t) / k for k in range(1, 6)) / 2.3
    envelope = np.zeros_like(t)
    for a, b in phrases:
        word = (t >= a) & (t < b) & (((t - a) % 0.35) < 0.25)
        envelope[word] = 0.6 + 0.4 * np.sin(2 * np.pi * 5 * t[word])
    x = voice * envelope
    return (peak * x / np.abs(x).max()).astype(np.float32)


def region(x: np.ndarray, a: float, b: float) -> np.ndarray:
    return x[round(a * R):round(b * R)]


def test_bed_is_duck_db_lower_under_speech_than_in_the_gaps(tmp_path):
    bed_file = write_audio(tmp_path / "bed.mp3", tones(20.0, 0.8, 44_100), 44_100)
    speech = speech_like(14.0, [(2.0, 4.0), (8.0, 10.0)], peak=0.5)
    music = Music(file=bed_file, gain_db=-18.0, duck_db=-12.0)
    mixed = mix_music(speech, music)
    assert mixed.dtype == np.float32 and mixed.shape == speech.shape
    bed = mixed - speech
    gap = db(region(bed, 5.5, 7.5))
    under = db(region(bed, 2.4, 3.9)), db(region(bed, 8.4, 9.9))
    for level in under:
        assert abs((level - gap) - (-12.0)) < 1.0, (gap, under)
    # the gaps carry the bed at gain_db relative to its file
    assert abs(gap - (db(tones(2.0, 0.8)) - 18.0)) < 1.0
    assert np.abs(mixed).max() <= 1.0


def test_loud_speech_and_loud_bed_never_pass_full_scale(tmp_path):
    """Speech and bed each just under the -1 dBFS ceiling: the sum is held under it by the bed alone."""
    bed_file = write_audio(tmp_path / "bed.wav", tones(6.0, 0.88), R)
    speech = speech_like(6.0, [(1.5, 4.5)], peak=0.88)
    mixed = mix_music(speech, Music(file=bed_file, gain_db=0.0, duck_db=0.0))
    assert np.abs(mixed).max() <= CEILING
    bed = mixed - speech
    # the limiter only touches the bed where the sum needed it: the gap before the speech keeps full level
    assert abs(db(region(bed, 1.1, 1.4)) - db(tones(1.0, 0.88))) < 0.5
    # and the bed is still there under the speech, only pulled down
    assert db(region(bed, 2.0, 4.0)) > db(tones(1.0, 0.88)) - 20


def test_speech_over_the_ceiling_is_limited_not_clipped(tmp_path):
    """A float speech file peaking over full scale: the whole mix comes down under the ceiling, smoothly
    (no sample is cut flat at +-1)."""
    bed_file = write_audio(tmp_path / "bed.wav", tones(6.0, 0.3), R)
    speech = speech_like(6.0, [(1.5, 4.5)], peak=1.5)
    mixed = mix_music(speech, Music(file=bed_file, gain_db=0.0, duck_db=0.0))
    assert np.abs(mixed).max() <= CEILING
    flat = np.sum(np.abs(mixed) >= CEILING - 1e-6)
    assert flat < np.sum(np.abs(speech) > CEILING) / 20  # a clip would flatten every one of those


def test_gain_curve_has_no_clicks():
    speech = np.zeros(4 * R, np.float32)
    speech[R:2 * R] = 0.9  # the hardest case: a full-scale step on and off
    speech[R:2 * R] *= np.sign(np.sin(2 * np.pi * 200 * np.arange(R) / R))
    g = duck_gain(speech, R, -12.0)
    assert g.shape == speech.shape
    assert np.abs(np.diff(g)).max() < 1e-3  # 0.75 of swing over >= 30 ms, never one step
    assert g[round(0.5 * R)] == pytest.approx(1.0, abs=1e-3)
    assert g[round(1.5 * R)] == pytest.approx(10 ** (-12 / 20), abs=1e-3)
    assert g[round(3.9 * R)] == pytest.approx(1.0, abs=1e-2)
    # silence ducks nothing
    assert np.all(duck_gain(np.zeros(R, np.float32), R, -12.0) == 1.0)


def test_loop_and_pad_lengths(tmp_path):
    short = write_audio(tmp_path / "short.wav", tones(1.5, 0.5), R)
    looped = load_music(Music(file=short, gain_db=0.0, loop=True), 5 * R)
    padded = load_music(Music(file=short, gain_db=0.0, loop=False), 5 * R)
    assert looped.shape == padded.shape == (5 * R,)
    # looped: the bed goes on at its level past its own length, with no dropout at the seams
    windows = looped[R:4 * R].reshape(-1, 480)  # 10 ms windows, away from the fades
    levels = 20 * np.log10(np.sqrt(np.mean(windows.astype(np.float64) ** 2, axis=1)))
    assert levels.min() > db(tones(1.0, 0.5)) - 3.0
    # padded: silence after the file's 1.5 s
    assert db(region(padded, 1.2, 1.45)) > -20
    assert np.abs(region(padded, 1.51, 5.0)).max() == 0.0
    # gain_db scales the bed
    quiet = load_music(Music(file=short, gain_db=-20.0), 5 * R)
    assert db(region(quiet, 2, 3)) - db(region(looped, 2, 3)) == pytest.approx(-20.0, abs=0.1)


def test_fades_at_the_ends_of_the_show(tmp_path):
    bed = load_music(Music(file=write_audio(tmp_path / "bed.wav", tones(8.0, 0.5), R), gain_db=0.0), 6 * R)
    steady = db(region(bed, 2, 4))
    assert db(region(bed, 0.0, 0.05)) < steady - 30
    assert db(region(bed, 0.48, 0.52)) == pytest.approx(steady - 6.0, abs=1.0)  # raised cosine: half way
    assert db(region(bed, 1.05, 1.5)) == pytest.approx(steady, abs=0.2)
    assert db(region(bed, 5.48, 5.52)) == pytest.approx(steady - 6.0, abs=1.0)
    assert db(region(bed, 5.95, 6.0)) < steady - 30
    assert abs(float(bed[-1])) < 1e-3 and abs(float(bed[0])) < 1e-3


def test_missing_or_undecodable_bed_is_a_one_line_error(tmp_path):
    speech = np.zeros(R, np.float32)
    with pytest.raises(InputError) as e:
        mix_music(speech, Music(file=tmp_path / "nope.mp3"))
    assert "nope.mp3" in str(e.value) and "\n" not in str(e.value)
    junk = tmp_path / "junk.mp3"
    junk.write_bytes(b"this is not an mp3 file at all" * 50)
    with pytest.raises(InputError) as e:
        mix_music(speech, Music(file=junk))
    assert "junk.mp3" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_a_loud_bed_at_a_large_gain_never_clips_the_delivered_aac_track(tmp_path, presenter, tiny_models):
    """`music: {gain_db: 60}` over a dense bed: the limiter holds the samples under full scale, but AAC
    overshoots such a track (it came back at +2.3 dBFS). The MP4's AAC track, decoded, stays under 1.0."""
    import av

    from lipstream.fixtures import speech_like as speech
    from lipstream.render.options import RenderOptions
    from lipstream.render.program import render_program
    from lipstream.render.script import load_script

    rng = np.random.default_rng(0)
    t = np.arange(3 * R) / R
    bed = np.clip(0.5 * np.sign(np.sin(2 * np.pi * 110 * t)) + 0.3 * rng.standard_normal(t.size), -1, 1)
    write_audio(tmp_path / "bed.wav", bed.astype(np.float32), R)
    write_audio(tmp_path / "story.wav", speech(2.0, 16_000, seed=3), 16_000)
    (tmp_path / "show.yaml").write_text(f"avatars: {presenter.parent}\nscenes:\n  - {{avatar: p, audio: story.wav}}\n"
                                        "music: {file: bed.wav, gain_db: 60, duck_db: -12}\n")
    render_program(load_script(tmp_path / "show.yaml"), tmp_path / "show.mp4", tiny_models,
                   RenderOptions(progress=False))
    with av.open(str(tmp_path / "show.mp4")) as c:
        audio = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])
    assert audio.size >= 1.9 * R
    assert np.abs(audio).max() <= 1.0, f"peak {20 * np.log10(np.abs(audio).max()):+.2f} dBFS"
    assert db(audio) > -20  # the bed is there, loud: only its overshoot was taken off
