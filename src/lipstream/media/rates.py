"""Exact frame rates, and the one audio rate of every output. Kept free of torch: the CLI checks `--fps` with
it before loading anything, and the worker processes import it."""

from __future__ import annotations

from fractions import Fraction

AUDIO_RATE = 48_000  # what every output carries: AAC in files, Opus (and PCM to WebRTC) live
NTSC_RATES = (Fraction(24000, 1001), Fraction(30000, 1001), Fraction(60000, 1001))


def as_fps(fps: float | int | Fraction | str) -> Fraction:
    """An exact frame rate: 25 -> 25, "30000/1001" -> 30000/1001, 29.97 -> 30000/1001 (NTSC).

    Raises ValueError for anything that is not a positive number.
    """
    try:
        value = Fraction(fps) if not isinstance(fps, float) else Fraction(fps).limit_denominator(1_000_000)
    except (ValueError, ZeroDivisionError, TypeError, OverflowError):
        raise ValueError(f"not a frame rate: {fps!r}") from None
    for ntsc in NTSC_RATES:  # 23.976 / 29.97 / 59.94 written as decimals mean the NTSC rates
        if value != ntsc and abs(value - ntsc) < Fraction(1, 200) and (value * 1000).denominator == 1:
            return ntsc
    if value <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    return value
