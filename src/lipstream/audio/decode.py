"""Decode any audio (or a video's audio track) to 16 kHz mono float32, in-process with PyAV.

PyAV demuxes and decodes; sample-format conversion, the channel mix and resampling
(resample.py) are a few torch kernels over the whole clip, on the GPU when there is one. Mono is the mean of the channels, as librosa (MuseTalk's loader) does.
"""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import torch

from lipstream.audio.resample import resample
from lipstream.errors import InputError
from lipstream.files import check_file
from lipstream.media.demux import open_input
from lipstream.models.config import SAMPLE_RATE

MAX_SECONDS = 4 * 3600  # a longer "speech" file is a mistake, and would need GBs of features
TRUNCATION_TOLERANCE_S = 0.5  # decoded vs declared duration before a compressed file counts as cut short
WAV_TOLERANCE_S = 0.01  # a WAV header states its data size exactly

# integer sample formats -> (offset, scale) that map them to [-1, 1)
_INT_SCALE = {torch.uint8: (128.0, 1 / 128), torch.int16: (0.0, 1 / 2**15),
              torch.int32: (0.0, 1 / 2**31), torch.int64: (0.0, 1 / 2**63)}


def decode_audio(path: str | Path) -> tuple[np.ndarray, int]:
    """The decoded samples as [channels, n] in the codec's own dtype, and the sample rate.

    Raises InputError (naming the file) for a missing file, a folder, a file with no audio
    stream, undecodable or truncated data, and audio with no samples.
    """
    path = check_file(path, "audio file")
    if path.stat().st_size == 0:
        raise InputError(path, "is empty (0 bytes)")
    try:
        container = open_input(path, _open_options(path))
    except av.error.FFmpegError as e:
        raise InputError(path, f"not a readable audio or video file ({_reason(e)})") from None
    with container:
        stream = next((s for s in container.streams if s.type == "audio"), None)
        if stream is None:
            raise InputError(path, "has no audio stream")
        declared = _declared_seconds(container, stream)
        tolerance = WAV_TOLERANCE_S if container.format.name == "wav" else TRUNCATION_TOLERANCE_S
        try:
            planes, rate = _decode_planes(path, container, stream)
        except av.error.FFmpegError as e:
            raise InputError(path, f"corrupt audio data ({_reason(e)})") from None
    data = np.concatenate(planes, axis=1) if planes else np.zeros((1, 0), np.float32)
    if data.shape[1] == 0:
        raise InputError(path, "contains no audio samples (zero-length audio)")
    decoded = data.shape[1] / rate
    if declared is not None and declared - decoded > max(tolerance, 0.02 * declared if tolerance > WAV_TOLERANCE_S else 0):
        raise InputError(path, f"is truncated or damaged: its header says {declared:.2f} s, "
                               f"only {decoded:.2f} s could be decoded")
    return data, rate


def load_mono(path: str | Path, device: str | torch.device = "cpu") -> tuple[torch.Tensor, int]:
    """[n] float32 mono samples at the file's own rate on `device`, and that rate.

    The one loader every path goes through (features, the output's audio track): besides
    decode_audio's checks it refuses NaN or infinite samples, which a float WAV can hold and
    which no encoder or network can use.
    """
    data, rate = decode_audio(path)
    x = to_mono_float(torch.from_numpy(data).to(device, non_blocking=True))
    if data.dtype.kind == "f":
        bad = ~torch.isfinite(x)
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0]) / rate
            raise InputError(path, f"holds NaN or infinite samples (the first at {first:.3f} s): "
                                   "the file is damaged; re-export it")
    return x, rate


def load_audio_tensor(path: str | Path, device: str | torch.device = "cpu",
                      sample_rate: int = SAMPLE_RATE) -> torch.Tensor:
    """[n] float32 mono samples at `sample_rate` on `device`; conversion and resampling run there."""
    x, rate = load_mono(path, device)
    return resample(x, rate, sample_rate)


def load_audio(path: str | Path, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Mono float32 samples at `sample_rate` (16 kHz), from any format FFmpeg reads.

    Full scale is [-1, 1]; float files that exceed it are returned as they are, not clipped.
    """
    return load_audio_tensor(path, "cpu", sample_rate).numpy()


def to_mono_float(data: torch.Tensor) -> torch.Tensor:
    """[channels, n] samples of any PCM dtype -> [n] float32 in [-1, 1): scale, then mean of channels."""
    if data.dtype in _INT_SCALE:
        offset, scale = _INT_SCALE[data.dtype]
        x = (data.to(torch.float64 if data.dtype in (torch.int32, torch.int64) else torch.float32) - offset) * scale
    else:
        x = data
    x = x.mean(dim=0) if x.shape[0] > 1 else x[0]
    return x.to(torch.float32).contiguous()


def _open_options(path: Path) -> dict[str, str]:
    """WAV headers say everything: skip FFmpeg's stream probing and read 64 KiB packets.

    For a minute of 48 kHz stereo that turns ~30 ms of probing and 700 tiny packets into ~2 ms.
    Other formats keep FFmpeg's defaults.
    """
    with open(path, "rb") as f:
        magic = f.read(12)
    if magic[:4] in (b"RIFF", b"RF64", b"BW64") and magic[8:12] == b"WAVE":
        return {"probesize": "32", "max_size": "65536"}
    return {}


def _decode_planes(path: Path, container: av.container.InputContainer,
                   stream: av.audio.stream.AudioStream) -> tuple[list[np.ndarray], int]:
    """Decoded samples as [channels, n] arrays in the codec's own dtype, plus the sample rate.

    Frames whose format, layout or rate differ from the first (rare mid-stream changes) are
    converted to the first frame's with libswresample.
    """
    planes: list[np.ndarray] = []
    first: tuple[str, str, int] | None = None
    fixer: av.AudioResampler | None = None
    count = 0
    for frame in container.decode(stream):
        key = (frame.format.name, frame.layout.name, frame.sample_rate)
        if first is None:
            first = key
        frames = [frame]
        if key != first:
            frame.pts = None
            fixer = fixer or av.AudioResampler(format=first[0], layout=first[1], rate=first[2])
            frames = fixer.resample(frame)
        for f in frames:
            planes.append(_planar(f))
            count += f.samples
        if first and count > MAX_SECONDS * first[2]:
            raise InputError(path, f"is longer than {MAX_SECONDS // 3600} hours; split it first")
    return planes, (first[2] if first else SAMPLE_RATE)


def _planar(frame: av.AudioFrame) -> np.ndarray:
    data = frame.to_ndarray()
    if frame.format.is_planar:
        return data[:, : frame.samples]
    channels = len(frame.layout.channels)
    return data.reshape(-1, channels)[: frame.samples].T  # packed: interleaved samples


def _declared_seconds(container: av.container.InputContainer, stream: av.audio.stream.AudioStream) -> float | None:
    """Duration the file claims. FFmpeg sizes a WAV from the file length, so read its header ourselves."""
    if container.format.name == "wav":
        return _wav_declared_seconds(container.name, stream)
    if stream.duration is not None and stream.time_base:  # PyAV 19: an unset time base is falsy, not None
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
            bytes_per_second = (stream.codec_context.bit_rate or 0) / 8
            if size in (0, 0xFFFFFFFF) or bytes_per_second <= 0:
                return None
            return size / bytes_per_second
        pos += 8 + size + (size & 1)
    return None


def _reason(e: BaseException) -> str:
    return getattr(e, "strerror", None) or str(e) or type(e).__name__
