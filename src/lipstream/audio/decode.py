"""Decode any audio (or a video's audio track) to 16 kHz mono float32 with PyAV, in-process."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np

from lipstream.errors import InputError, check_file
from lipstream.models.config import SAMPLE_RATE

MAX_SECONDS = 4 * 3600  # a longer "speech" file is a mistake, and would need GBs of features
TRUNCATION_TOLERANCE_S = 0.5  # decoded vs declared duration before a file counts as cut short


def load_audio(path: str | Path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Mono float32 samples in [-1, 1] at `sample_rate`, from any container/codec FFmpeg reads.

    Raises InputError (naming the file) for a missing file, a folder, a file with no audio
    stream, undecodable or truncated data, and audio with no samples.
    """
    path = check_file(path, "audio file")
    try:
        container = av.open(str(path), metadata_errors="ignore")
    except av.error.FFmpegError as e:
        raise InputError(path, f"not a readable audio or video file ({_reason(e)})") from None
    with container:
        stream = next((s for s in container.streams if s.type == "audio"), None)
        if stream is None:
            raise InputError(path, "has no audio stream")
        declared = _declared_seconds(container, stream)
        resampler: av.AudioResampler | None = None
        chunks: list[np.ndarray] = []
        count = 0
        try:
            for frame in container.decode(stream):
                frame.pts = None  # let the resampler count samples; broken timestamps must not drop audio
                if resampler is None:  # keep the channels: mono is their mean, as librosa/whisper do
                    resampler = av.AudioResampler(format="fltp", layout=frame.layout.name, rate=sample_rate)
                for out in resampler.resample(frame):
                    chunks.append(_mono(out.to_ndarray()))
                    count += out.samples
                if count > MAX_SECONDS * sample_rate:
                    raise InputError(path, f"is longer than {MAX_SECONDS // 3600} hours; split it first")
            for out in resampler.resample(None) if resampler is not None else ():
                chunks.append(_mono(out.to_ndarray()))
        except av.error.FFmpegError as e:
            raise InputError(path, f"corrupt audio data ({_reason(e)})") from None
    samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    if samples.size == 0:
        raise InputError(path, "contains no audio samples (zero-length audio)")
    decoded = samples.size / sample_rate
    if declared is not None and declared - decoded > max(TRUNCATION_TOLERANCE_S, 0.02 * declared):
        raise InputError(path, f"is truncated or damaged: its header says {declared:.2f} s, "
                               f"only {decoded:.2f} s could be decoded")
    if not np.isfinite(samples).all():
        raise InputError(path, "decoded to non-finite samples (corrupt data)")
    return np.ascontiguousarray(samples, dtype=np.float32)


def _mono(planar: np.ndarray) -> np.ndarray:
    return planar[0] if planar.shape[0] == 1 else planar.mean(axis=0, dtype=np.float32)


def _declared_seconds(container: av.container.InputContainer, stream: av.audio.stream.AudioStream) -> float | None:
    """Duration the file claims. FFmpeg sizes a WAV from the file length, so read its header ourselves."""
    if container.format.name == "wav":
        return _wav_declared_seconds(container.name, stream)
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / av.time_base
    return None


def _wav_declared_seconds(name: str, stream: av.audio.stream.AudioStream) -> float | None:
    """Seconds in the RIFF 'data' chunk header, or None when the header leaves it open (streamed WAVs)."""
    try:
        with open(name, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return None
    pos = 12
    while pos + 8 <= len(head):
        chunk, size = head[pos:pos + 4], int.from_bytes(head[pos + 4:pos + 8], "little")
        if chunk == b"data":
            ctx = stream.codec_context
            bytes_per_second = (ctx.bit_rate or 0) / 8
            if size in (0, 0xFFFFFFFF) or bytes_per_second <= 0:
                return None
            return size / bytes_per_second
        pos += 8 + size + (size & 1)
    return None


def _reason(e: BaseException) -> str:
    return getattr(e, "strerror", None) or str(e) or type(e).__name__
