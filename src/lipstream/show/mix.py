"""Music under the speech: the bed looped (or padded) to the show, faded at its ends, ducked by a side chain
that follows the presenters' speech, and kept below full scale in the delivered file.

Everything is numpy over the whole show at 48 kHz (a minute is ~3 M samples, a few tens of ms of work):
the show's audio is known in full before the render encodes it, so the ducker can look ahead and the
limiter needs no latency tricks.

Below full scale as samples is not enough: AAC's quantisation overshoots a dense, loud track (a bed at a
large `gain_db`, pulled to the ceiling by the limiter, came back at +2.3 dBFS, clipped by every player).
So the mix is limited to -1 dBFS, then encoded once as the MP4 writer will encode it and decoded: where
that copy passes AAC_PEAK, the whole track is scaled down by the overshoot and tried again.
"""

from __future__ import annotations

import numpy as np

from lipstream.audio.decode import load_mono
from lipstream.audio.resample import resample
from lipstream.media.rates import AUDIO_RATE
from lipstream.show.spec import Music

SHOW_FADE_S = 1.0  # the bed fades in at the show's start and out at its end
LOOP_CROSSFADE_S = 0.02  # each loop of the bed crossfades into the next: a bare seam clicks
CEILING = 0.891  # -1 dBFS: the bed is pulled down where speech + bed would pass this
AAC_PEAK = 0.97  # the most the AAC track may decode to (a little under full scale: encoders differ slightly)
AAC_BITRATE = 128_000  # the MP4 writer's (media/mp4.py)
AAC_TRIES = 4
LIMIT_WINDOW_S = 0.005  # the bed limiter's look-ahead and smoothing


def load_music(music: Music, samples: int, rate: int = AUDIO_RATE) -> np.ndarray:
    """The bed as [samples] float32 mono at `rate`: looped (music.loop) or padded with silence, at gain_db,
    with a raised-cosine fade of ~1 s at both ends of the show.

    Raises InputError naming music.file for a missing, empty or undecodable file (load_mono's checks).
    """
    x, file_rate = load_mono(music.file)
    bed = resample(x, file_rate, rate).numpy().astype(np.float32, copy=False)
    out = _loop(bed, samples, round(LOOP_CROSSFADE_S * rate)) if music.loop else _pad(bed, samples)
    out *= np.float32(10 ** (music.gain_db / 20))
    fade = min(round(SHOW_FADE_S * rate), samples // 2)
    if fade > 0:
        ramp = _rise(fade)
        out[:fade] *= ramp
        out[samples - fade:] *= ramp[::-1]
    return out


def duck_gain(speech: np.ndarray, rate: int, duck_db: float, attack_s: float = 0.03, release_s: float = 0.25,
              window_s: float = 0.02, threshold_db: float = -30.0, hold_s: float = 0.3,
              floor_db: float = -60.0) -> np.ndarray:
    """Per-sample gain for the bed: 1.0 in the gaps, 10**(duck_db/20) under speech.

    Speech is where the RMS over `window_s` is within `threshold_db` of the speech's loudest window (and
    above `floor_db` dBFS, so a silent track ducks nothing). Each such region is extended by `hold_s` after
    it (gaps between words do not pump the bed) and by `attack_s` before it (the whole show is known, so the
    bed is already going down when the first syllable starts). The two-level target is then smoothed by a
    one-pole filter with time constant attack_s going down and release_s going up: no step in the curve,
    at most (1 - duck) / (attack_s * rate) per sample.
    """
    x = np.asarray(speech, np.float32).reshape(-1)
    n = x.size
    duck = 10 ** (duck_db / 20)
    if n == 0:
        return np.ones(0, np.float32)
    rms = np.sqrt(_moving_mean(x.astype(np.float64) ** 2, max(1, round(window_s * rate))))
    loudest = float(rms.max())
    limit = max(loudest * 10 ** (threshold_db / 20), 10 ** (floor_db / 20))
    active = _dilate(rms > limit, before=round(attack_s * rate), after=round(hold_s * rate))
    target = np.where(active, duck, 1.0)
    return _one_pole(target, 1.0, np.exp(-1 / max(attack_s * rate, 1.0)), np.exp(-1 / max(release_s * rate, 1.0)))


def mix_music(speech: np.ndarray, music: Music, rate: int = AUDIO_RATE) -> np.ndarray:
    """speech + the ducked bed, float32 mono, as long as `speech`, never above full scale once AAC-encoded.

    Where |speech| + |bed| would pass CEILING, the bed's gain is pulled down (a look-ahead limiter, smoothed
    over ~5 ms so it does not click) and the speech is left untouched; a speech track that itself passes
    the ceiling (a float file) is limited the same way as a whole. Then fit_for_aac: the track scaled down
    by AAC's overshoot, if it has one.
    """
    s = np.asarray(speech, np.float32).reshape(-1)
    window = max(1, round(LIMIT_WINDOW_S * rate))
    bed = load_music(music, s.size, rate) * duck_gain(s, rate, music.duck_db)
    bed *= _bed_limit(s, bed, window)
    mixed = (s + bed).astype(np.float32)
    if np.abs(mixed).max() > CEILING:  # the speech alone passes the ceiling: the whole bus comes down there
        mixed *= _bed_limit(np.zeros_like(mixed), mixed, window)
    return fit_for_aac(mixed, rate)


def fit_for_aac(track: np.ndarray, rate: int = AUDIO_RATE) -> np.ndarray:
    """`track` scaled so that its AAC encoding (as the MP4 writer makes it) decodes to at most AAC_PEAK:
    limited samples are not enough, AAC overshoots a dense loud track by up to ~6 dB."""
    out = np.asarray(track, np.float32)
    for _ in range(AAC_TRIES):
        peak = _aac_peak(out, rate)
        if peak <= AAC_PEAK:
            return out
        out = out * np.float32(AAC_PEAK / peak * 0.98)
    return out


def _aac_peak(track: np.ndarray, rate: int) -> float:
    """The largest sample of `track` encoded to AAC (mono, AAC_BITRATE) and decoded again, in memory."""
    import io

    import av

    if track.size == 0:
        return 0.0
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="adts") as container:
        stream = container.add_stream("aac", rate=rate, layout="mono")
        stream.bit_rate = AAC_BITRATE
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(track[None, :]), format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    buffer.seek(0)
    peak = 0.0
    with av.open(buffer, "r", format="adts") as container:
        for decoded in container.decode(audio=0):
            peak = max(peak, float(np.abs(decoded.to_ndarray()).max(initial=0.0)))
    return peak


def _rise(n: int) -> np.ndarray:
    """A raised-cosine ramp from 0 to 1 over n samples."""
    return (0.5 - 0.5 * np.cos(np.pi * (np.arange(n) + 0.5) / n)).astype(np.float32)


def _pad(bed: np.ndarray, samples: int) -> np.ndarray:
    out = np.zeros(samples, np.float32)
    out[:min(samples, bed.size)] = bed[:samples]
    return out


def _loop(bed: np.ndarray, samples: int, crossfade: int) -> np.ndarray:
    """The bed repeated to `samples`: its first pass as it is, then each repeat starting with the tail of
    the one before crossfaded (raised cosine, equal gain) into its own start."""
    if bed.size >= samples:
        return bed[:samples].copy()
    if bed.size <= 2 * crossfade:  # too short to crossfade: repeat it bare
        return np.resize(bed, samples).astype(np.float32)
    period = bed.size - crossfade
    ramp = _rise(crossfade)
    unit = bed[:period].copy()
    unit[:crossfade] = bed[:crossfade] * ramp + bed[period:] * ramp[::-1]
    repeats = -(-(samples - period) // period)
    return np.concatenate([bed[:period], np.tile(unit, repeats)])[:samples]


def _moving_mean(x: np.ndarray, width: int) -> np.ndarray:
    """Moving average over `width` samples centred on each (the window shifted or cut at the ends, and the
    mean taken over the samples it holds), same length as x."""
    c = np.concatenate([[0.0], np.cumsum(x, dtype=np.float64)])
    lo = np.clip(np.arange(x.size) - width // 2, 0, x.size)
    hi = np.clip(lo + width, 0, x.size)
    return (c[hi] - c[lo]) / np.maximum(hi - lo, 1)


def _dilate(mask: np.ndarray, before: int, after: int) -> np.ndarray:
    """True where `mask` is true within `before` samples later or `after` samples earlier."""
    c = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    i = np.arange(mask.size)
    lo = np.clip(i - after, 0, mask.size)
    hi = np.clip(i + before + 1, 0, mask.size)
    return c[hi] > c[lo]


def _one_pole(target: np.ndarray, start: float, down: float, up: float) -> np.ndarray:
    """g[n] = t[n] + (g[n-1] - t[n]) * c, c = `down` when t falls below g, `up` when it rises.

    `target` is piecewise constant, so each run is one exponential: vectorised per run, exact per sample.
    """
    out = np.empty(target.size, np.float32)
    edges = np.flatnonzero(np.diff(target)) + 1
    g = start
    for a, b in zip(np.concatenate([[0], edges]), np.concatenate([edges, [target.size]])):
        t = float(target[a])
        c = down if t < g else up
        run = t + (g - t) * c ** np.arange(1, b - a + 1, dtype=np.float64)
        out[a:b] = run
        g = float(run[-1])
    return out


def _bed_limit(speech: np.ndarray, bed: np.ndarray, window: int) -> np.ndarray:
    """Gain in [0, 1] for the bed so that |speech| + gain * |bed| <= CEILING at every sample.

    The needed gain is taken as the minimum over blocks of `window` samples and their neighbours, then
    averaged over `window`: every average only reads minima that include the sample itself, so the smooth
    curve stays at or under what each sample needs.
    """
    room = np.maximum(CEILING - np.abs(speech), 0.0)
    need = np.ones(speech.size, np.float32)
    loud = np.abs(bed) > room
    if not loud.any():
        return need
    need[loud] = room[loud] / np.abs(bed[loud])
    blocks = -(-need.size // window)
    padded = np.ones(blocks * window, np.float32)
    padded[:need.size] = need
    bmin = padded.reshape(blocks, window).min(axis=1)
    bmin = np.minimum(bmin, np.minimum(np.r_[1.0, bmin[:-1]], np.r_[bmin[1:], 1.0]))
    held = np.repeat(bmin, window)[:need.size]
    return np.minimum(_moving_mean(held, window), 1.0).astype(np.float32)
