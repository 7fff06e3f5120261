"""Writes the example show's media (committed beside it; run again to remake them):
logo.png, chart.png (stills), footage.mp4 (a 3 s clip for the picture-in-picture), bed.m4a (a music bed)
and story.wav (the first scene's speech, espeak-ng).

    python examples/newsroom/make_assets.py
"""

from __future__ import annotations

import subprocess
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
from PIL import Image, ImageDraw, ImageFont

HERE = Path(__file__).resolve().parent


def logo() -> None:
    img = Image.new("RGBA", (220, 80), (0, 0, 0, 0))
    d = ImageDraw.Draw(img)
    d.rounded_rectangle((0, 0, 219, 79), radius=14, fill=(200, 20, 40, 235))
    d.text((110, 40), "LS NEWS", font=ImageFont.load_default(size=40), fill="white", anchor="mm")
    img.save(HERE / "logo.png")


def chart() -> None:
    img = Image.new("RGB", (1600, 900), (16, 24, 48))
    d = ImageDraw.Draw(img)
    d.text((80, 60), "Markets today", font=ImageFont.load_default(size=72), fill="white")
    for i, v in enumerate((0.35, 0.5, 0.42, 0.61, 0.58, 0.74, 0.83)):
        x = 120 + i * 200
        d.rectangle((x, 820 - int(600 * v), x + 140, 820), fill=(40, 190, 120))
    img.save(HERE / "chart.png")


def footage(seconds: float = 3.0, fps: int = 25) -> None:
    with av.open(str(HERE / "footage.mp4"), "w") as c:
        s = c.add_stream("libx264", rate=fps, options={"crf": "28", "preset": "veryslow"})
        s.width, s.height, s.pix_fmt = 640, 360, "yuv420p"
        y, x = np.mgrid[0:360, 0:640]
        font = ImageFont.load_default(size=48)
        for i in range(int(seconds * fps)):
            t = i / fps
            rgb = np.stack([(x / 640 * 255 + 80 * t) % 256, (y / 360 * 200 + 40 * t) % 256,
                            np.full_like(x, 140)], -1).astype(np.uint8)
            img = Image.fromarray(rgb)
            ImageDraw.Draw(img).text((20, 290), f"LIVE  {t:4.2f} s", font=font, fill="white")
            for p in s.encode(av.VideoFrame.from_ndarray(np.asarray(img), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def bed(seconds: float = 8.0, rate: int = 48000) -> None:
    t = np.arange(int(seconds * rate)) / rate
    chords = [(220.0, 277.2, 329.6), (196.0, 246.9, 293.7)]
    out = np.zeros_like(t)
    for k, chord in enumerate(chords):
        part = (t >= k * seconds / 2) & (t < (k + 1) * seconds / 2)
        for f in chord:
            out[part] += np.sin(2 * np.pi * f * t[part]) / 3
    out *= 0.5 * (0.6 + 0.4 * np.sin(2 * np.pi * 2 * t) ** 2)  # a pulse, so the ducking is audible
    with av.open(str(HERE / "bed.m4a"), "w") as c:
        s = c.add_stream("aac", rate=rate, layout="mono")
        s.bit_rate = 48000
        frame = av.AudioFrame.from_ndarray(out.astype(np.float32)[None], format="fltp", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = rate, 0, Fraction(1, rate)
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode():
            c.mux(p)


def story() -> None:
    subprocess.run(["espeak-ng", "-w", str(HERE / "story.wav"),
                    "Good evening. The city council approved the new tram line today, after a long debate."],
                   check=True)


if __name__ == "__main__":
    logo(), chart(), footage(), bed(), story()
    for p in sorted(HERE.iterdir()):
        print(p.name, p.stat().st_size)
