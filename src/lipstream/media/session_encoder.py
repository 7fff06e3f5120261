"""Per-session low-latency encoding of a live stream: I420 frames + audio slices in, RTP-ready packets out.

One `SessionEncoder` per viewer session: libx264 (zerolatency, no B-frames, Annex-B with SPS/PPS repeated at
every keyframe, so a packetiser needs no out-of-band parameter sets) and Opus or AAC. Kept free of torch and
the rest of LipStream, so an encode worker process (encode_worker.py) imports it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
from av.video.frame import PictureType

_AUDIO = {"opus": ("libopus", "flt"), "aac": ("aac", "fltp")}  # our name -> (encoder, sample format)


@dataclass(frozen=True)
class EncodedPacket:
    kind: str  # "video" or "audio"
    data: bytes  # video: Annex-B access unit; audio: one raw codec frame (no ADTS / Ogg framing)
    pts: int  # in time_base units
    dts: int
    time_base: Fraction  # video: 1/fps; audio: 1/sample_rate
    keyframe: bool

    @property
    def time_s(self) -> float:
        return float(self.pts * self.time_base)


class SessionEncoder:
    """Low-latency H.264 + Opus (or AAC) for one live session: packets out as soon as each frame goes in."""

    def __init__(self, width: int, height: int, fps: Fraction, *, audio: str = "opus",
                 sample_rate: int = 48_000, gop_frames: int | None = None, x264_preset: str = "ultrafast",
                 crf: int = 23, threads: int = 1, matrix: str = "bt601", audio_bitrate: int = 64_000):
        if width % 2 or height % 2:
            raise ValueError(f"yuv420p needs even dimensions, got {width}x{height}")
        if audio not in (*_AUDIO, "none"):
            raise ValueError(f"audio must be 'opus', 'aac' or 'none', got {audio!r}")
        self.width, self.height, self.fps = width, height, Fraction(fps)
        self.gop = max(1, gop_frames or round(self.fps))
        self.video_time_base = 1 / self.fps
        self.audio_time_base = Fraction(1, sample_rate)
        self._settings = (x264_preset, crf, threads, matrix, audio, sample_rate, audio_bitrate)
        self._open_codecs()
        self._last_pts: int | None = None
        self._next_key = 0  # pts at or after which the next frame is forced to be an IDR
        self._fifo = np.zeros(0, np.float32)
        self._samples_in = 0  # samples handed to the audio encoder (pts of the next audio frame)
        self._audio_pts = 0  # pts of the next audio packet out

    def _open_codecs(self) -> None:
        """Fresh x264 and audio contexts (at start, and on restart: nothing buffered survives)."""
        x264_preset, crf, threads, matrix, audio, sample_rate, audio_bitrate = self._settings
        self._video = ctx = av.CodecContext.create("libx264", "w")
        ctx.width, ctx.height, ctx.pix_fmt = self.width, self.height, "yuv420p"
        ctx.time_base, ctx.framerate = self.video_time_base, self.fps
        ctx.colorspace = {"bt709": 1, "bt601": 6}[matrix]
        ctx.options = {"preset": x264_preset, "tune": "zerolatency", "crf": str(crf), "bf": "0",
                       "g": str(self.gop), "keyint_min": str(self.gop), "sc_threshold": "0",
                       "forced-idr": "1", "x264-params": "repeat-headers=1"}
        ctx.thread_count = max(1, threads)  # no GLOBAL_HEADER flag: SPS/PPS stay in-band (Annex-B)
        ctx.open()
        self._audio: av.AudioCodecContext | None = None
        if audio != "none":
            name, self._sample_format = _AUDIO[audio]
            self._audio = a = av.CodecContext.create(name, "w")
            a.sample_rate, a.format, a.layout = sample_rate, self._sample_format, "mono"
            a.bit_rate, a.time_base = audio_bitrate, self.audio_time_base
            a.open()
            self.audio_frame_size = a.frame_size  # opus 960 (20 ms at 48 kHz), aac 1024

    def restart(self, video_pts: int, audio_pts: int) -> None:
        """Start both streams over (an interrupted session drops the frames it had encoded ahead).

        The old codec states and any buffered audio are thrown away; the next frame is an IDR and may
        carry any pts >= video_pts (lower than before too); audio packets go on from audio_pts (samples).
        """
        self._open_codecs()  # the old contexts are freed with their last reference
        self._last_pts = video_pts - 1
        self._next_key = video_pts
        self._fifo = np.zeros(0, np.float32)
        self._samples_in = self._audio_pts = audio_pts

    @property
    def video_extradata(self) -> bytes | None:
        """None: the H.264 parameter sets travel in-band at every keyframe."""
        return self._video.extradata

    @property
    def audio_extradata(self) -> bytes | None:
        """OpusHead (pre-skip, for a decoder) or the AAC AudioSpecificConfig (RTP fmtp 'config')."""
        return self._audio.extradata if self._audio is not None else None

    def request_keyframe(self) -> None:
        """Make the next frame an IDR (e.g. on an RTCP PLI/FIR from a viewer)."""
        self._next_key = self._last_pts + 1 if self._last_pts is not None else 0

    def encode(self, i420: np.ndarray, pts: int, audio: np.ndarray | None = None) -> list[EncodedPacket]:
        """pts = the frame's index in the session (frames may skip indices, never go back).

        audio = that frame's mono float32 samples (any count); video comes back at once, audio per full codec frame.
        """
        if i420.shape != (self.height * 3 // 2, self.width) or i420.dtype != np.uint8:
            raise ValueError(f"expected uint8 I420 of shape {(self.height * 3 // 2, self.width)}, "
                             f"got {i420.dtype} {i420.shape}")
        if self._last_pts is not None and pts <= self._last_pts:
            raise ValueError(f"video pts must rise: {pts} after {self._last_pts}")
        frame = av.VideoFrame.from_ndarray(i420, format="yuv420p")  # copies: the caller may reuse i420
        frame.pts = self._last_pts = pts
        if pts >= self._next_key:  # keyframes by time, not frame count, even when indices are skipped
            frame.pict_type = PictureType.I
            self._next_key = pts + self.gop
        out = self._video_packets(self._video.encode(frame))
        if audio is not None:
            out += self.encode_audio(audio)
        return out

    def encode_audio(self, audio: np.ndarray) -> list[EncodedPacket]:
        """Audio alone (a live session encodes it as it plays, video as it is rendered: separate codecs,
        so the two calls may come from different threads)."""
        if self._audio is None:
            return []
        samples = np.asarray(audio, dtype=np.float32).reshape(-1)
        if not np.isfinite(samples).all():  # AAC would fail with "returned 22"
            raise ValueError("audio holds NaN or infinite samples")
        self._fifo = np.concatenate([self._fifo, samples])
        return self._drain_fifo(final=False)

    def flush(self) -> list[EncodedPacket]:
        """End of session: pad the last partial audio frame with zeros and drain both encoders."""
        out = self._video_packets(self._video.encode(None))
        if self._audio is not None:
            out += self._drain_fifo(final=True) + self._audio_out(self._audio.encode(None))
        return out

    def _video_packets(self, packets) -> list[EncodedPacket]:
        return [EncodedPacket("video", bytes(p), p.pts, p.dts, self.video_time_base, bool(p.is_keyframe))
                for p in packets]

    def _drain_fifo(self, final: bool) -> list[EncodedPacket]:
        size, out = self.audio_frame_size, []
        if final and len(self._fifo) % size:
            self._fifo = np.concatenate([self._fifo, np.zeros(size - len(self._fifo) % size, np.float32)])
        while len(self._fifo) >= size:
            chunk, self._fifo = self._fifo[:size], self._fifo[size:]
            frame = av.AudioFrame.from_ndarray(np.clip(chunk, -1, 1)[None], format=self._sample_format,
                                               layout="mono")
            frame.sample_rate, frame.pts = self._audio.sample_rate, self._samples_in
            self._samples_in += size
            out += self._audio_out(self._audio.encode(frame))
        return out

    def _audio_out(self, packets) -> list[EncodedPacket]:
        """Audio pts count codec frames from 0 (or restart's audio_pts), not the encoder's own start at minus
        its delay: RTP wants 0, 960, ..."""
        out = []
        for p in packets:
            pts, self._audio_pts = self._audio_pts, self._audio_pts + self.audio_frame_size
            out.append(EncodedPacket("audio", bytes(p), pts, pts, self.audio_time_base, True))
        return out
