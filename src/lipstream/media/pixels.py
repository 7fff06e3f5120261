"""A live frame's I420 as an RGB picture for the stacks that take pictures (Pipecat, LiveKit), and back.

The engine hands out I420 in its avatar's colour matrix (avatar/colour.py); an RGB consumer must
convert with that same matrix, or skin tones shift. OpenCV's own I420 conversion is BT.601
limited range, the matrix of untagged video, and the fast path; BT.709 goes through the affine
map (avatar.colour.yuv_to_rgb_affine). numpy and OpenCV only: this runs on the callers' threads,
and OpenCV drops the GIL while it converts.
"""

from __future__ import annotations

import cv2
import numpy as np

from lipstream.avatar.colour import MATRICES, yuv_to_rgb_affine


def i420_to_rgb(i420: np.ndarray, matrix: str = "bt601", size: tuple[int, int] | None = None,
                out_format: str = "RGB") -> np.ndarray:
    """Packed I420 [H*3/2, W] uint8 -> [h, w, 3] (or 4 for "RGBA") uint8, resized to `size` (w, h) if given."""
    if matrix not in MATRICES:
        raise ValueError(f"matrix: {matrix!r}; one of {sorted(MATRICES)} is allowed")
    if out_format not in ("RGB", "RGBA"):
        raise ValueError(f"out_format: {out_format!r}; 'RGB' or 'RGBA' is allowed")
    rows, width = i420.shape
    height = rows * 2 // 3
    if matrix == "bt601":
        rgb = cv2.cvtColor(i420, cv2.COLOR_YUV2RGB_I420)
    else:
        y = i420[:height]
        chroma = i420[height:].reshape(2, height // 2, width // 2)
        u = cv2.resize(chroma[0], (width, height), interpolation=cv2.INTER_LINEAR)
        v = cv2.resize(chroma[1], (width, height), interpolation=cv2.INTER_LINEAR)
        rgb = cv2.transform(cv2.merge([y, u, v]), yuv_to_rgb_affine(matrix))
    if size is not None and tuple(size) != (width, height):
        shrink = size[0] < width
        rgb = cv2.resize(rgb, tuple(size), interpolation=cv2.INTER_AREA if shrink else cv2.INTER_LINEAR)
    if out_format == "RGBA":
        rgb = cv2.cvtColor(rgb, cv2.COLOR_RGB2RGBA)
    return rgb


def pcm16(audio: np.ndarray) -> bytes:
    """Float samples in [-1, 1] -> PCM16 little-endian bytes (clipped)."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def mono_pcm(pcm: bytes | bytearray | memoryview | np.ndarray, channels: int = 1) -> np.ndarray:
    """PCM16 bytes or an int16/float array, interleaved `channels` -> mono (int16 stays int16, else float32)."""
    if not 1 <= int(channels) <= 8:
        raise ValueError(f"channels: {channels}; 1 to 8 are allowed")
    x = np.frombuffer(pcm, dtype="<i2") if isinstance(pcm, (bytes, bytearray, memoryview)) else np.asarray(pcm)
    if channels == 1:
        return x
    if x.ndim == 2 and x.shape[-1] == channels:
        frames = x
    elif x.size % channels == 0:
        frames = x.reshape(-1, channels)
    else:
        raise ValueError(f"pcm: {x.size} samples do not split into {channels} interleaved channels")
    mixed = frames.astype(np.float32).mean(axis=1)
    return mixed.round().astype(np.int16) if x.dtype == np.int16 else mixed
