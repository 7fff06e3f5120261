"""Write H.264 (libx264, yuv420p) + AAC into one MP4 in a single pass, atomically.

Frames arrive as I420 planes, exactly what x264 takes: no colour conversion on the CPU. Audio is
encoded alongside, up to the time of the last video frame, so the muxer gets interleaved
packets. `+faststart` puts the index first so browsers start playing at once. The file is written
under a temporary name beside the output and renamed only when complete.
"""

from __future__ import annotations

import contextlib
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from lipstream.io import atomic_path

AUDIO_RATE = 48_000
AAC_FRAME = 1024


class MP4Writer:
    """Use as a context manager; the output appears only if the block finishes without an exception."""

    def __init__(self, dest: str | Path, width: int, height: int, fps: Fraction, audio: np.ndarray,
                 *, sample_rate: int = AUDIO_RATE, crf: int = 18, preset: str = "veryfast",
                 matrix: str = "bt601", audio_bitrate: int = 128_000):
        self.dest = Path(dest)
        self.fps = Fraction(fps)
        self.audio = np.ascontiguousarray(audio, dtype=np.float32)
        self.rate = sample_rate
        self.frames = 0
        self._audio_pos = 0
        self._atomic = atomic_path(self.dest)
        self._tmp = self._atomic.__enter__()
        try:
            self.container = av.open(str(self._tmp), "w", format="mp4", options={"movflags": "+faststart"})
            self.video = self.container.add_stream("libx264", rate=self.fps,
                                                   options={"crf": str(crf), "preset": preset})
            self.video.width, self.video.height, self.video.pix_fmt = width, height, "yuv420p"
            self.video.codec_context.time_base = 1 / self.fps
            self.video.codec_context.colorspace = {"bt709": 1, "bt601": 6}[matrix]  # tag what we blended in
            self.audio_stream = self.container.add_stream("aac", rate=sample_rate, layout="mono")
            self.audio_stream.bit_rate = audio_bitrate
        except BaseException as e:
            self._atomic.__exit__(type(e), e, e.__traceback__)
            raise

    def __enter__(self) -> "MP4Writer":
        return self

    def write(self, planes: np.ndarray) -> None:
        """Append one [H*3/2, W] uint8 I420 frame (and the audio up to its end)."""
        frame = av.VideoFrame.from_ndarray(planes, format="yuv420p")
        frame.pts, frame.time_base = self.frames, 1 / self.fps
        for packet in self.video.encode(frame):
            self.container.mux(packet)
        self.frames += 1
        self._write_audio(int(self.frames / self.fps * self.rate))

    def _write_audio(self, until: int, final: bool = False) -> None:
        until = min(until, self.audio.size)
        while self._audio_pos < until and (final or until - self._audio_pos >= AAC_FRAME):
            chunk = self.audio[self._audio_pos:self._audio_pos + min(AAC_FRAME, until - self._audio_pos)]
            frame = av.AudioFrame.from_ndarray(chunk[None], format="fltp", layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = self.rate, self._audio_pos, Fraction(1, self.rate)
            for packet in self.audio_stream.encode(frame):
                self.container.mux(packet)
            self._audio_pos += chunk.size

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            try:
                self._write_audio(self.audio.size, final=True)
                for stream in (self.video, self.audio_stream):
                    for packet in stream.encode(None):
                        self.container.mux(packet)
                self.container.close()
            except BaseException as e:
                with contextlib.suppress(Exception):
                    self.container.close()
                self._atomic.__exit__(type(e), e, e.__traceback__)
                raise
            self._atomic.__exit__(None, None, None)
        else:
            with contextlib.suppress(Exception):
                self.container.close()
            self._atomic.__exit__(exc_type, exc, tb)
