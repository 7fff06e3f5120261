"""A live frame's I420 as an RGB picture for the stacks that take pictures (Pipecat, LiveKit), and back.

The engine hands out I420 in its avatar's colour matrix (avatar/colour.py); an RGB consumer must
convert with that same matrix, or skin tones shift. OpenCV's own I420 conversion is BT.601
limited range, the matrix of untagged video, and the fast path; BT.709 goes through the affine
map (yuv_to_rgb_affine, here: avatar/colour.py's torch conversions use it too). numpy and OpenCV
only, no torch: this runs on the callers' threads (a remote client's too), and OpenCV drops the GIL
while it converts.
"""

from __future__ import annotations

import cv2
import numpy as np

# (Kr, Kb) of each matrix; limited ("TV") range: Y in [16, 235], Cb/Cr in [16, 240].
MATRICES = {"bt709": (0.2126, 0.0722), "bt601": (0.299, 0.114)}


def matrix_coefficients(matrix: str) -> tuple[float, float, float]:
    """(Kr, Kg, Kb) of a matrix."""
    kr, kb = MATRICES[matrix]
    return kr, 1 - kr - kb, kb


def yuv_to_rgb_affine(matrix: str) -> np.ndarray:
    """[3, 4] affine map from 8-bit (Y, U, V) code values to 8-bit (R, G, B), for cv2.transform."""
    kr, kg, kb = matrix_coefficients(matrix)
    to_rgb = np.array([[1, 0, 2 * (1 - kr)],
                       [1, -2 * (1 - kb) * kb / kg, -2 * (1 - kr) * kr / kg],
                       [1, 2 * (1 - kb), 0]])  # rows: R, G, B from (y, u, v) normalised
    norm = np.diag([1 / 219, 1 / 224, 1 / 224])
    offset = -norm @ np.array([16.0, 128.0, 128.0])
    m = 255 * to_rgb @ norm
    return np.hstack([m, (255 * to_rgb @ offset)[:, None]]).astype(np.float64)


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


def i420_resize(i420: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Packed I420 [H*3/2, W] -> packed I420 of `size` (width, height, both even), plane by plane."""
    rows, width = i420.shape
    height = rows * 2 // 3
    w, h = size
    if (w, h) == (width, height):
        return i420
    if w % 2 or h % 2:
        raise ValueError(f"size: {size!r}; even width and height are allowed for I420")
    how = cv2.INTER_AREA if w < width else cv2.INTER_LINEAR
    chroma = i420[height:].reshape(2, height // 2, width // 2)
    out = np.empty((h * 3 // 2, w), np.uint8)
    out[:h] = cv2.resize(i420[:height], (w, h), interpolation=how)
    planes = out[h:].reshape(2, h // 2, w // 2)
    for k in range(2):
        planes[k] = cv2.resize(chroma[k], (w // 2, h // 2), interpolation=how)
    return out


def default_matrix(tagged: str | None = None) -> str:
    """'bt709' or 'bt601' from a stream's colour-space tag (FFmpeg's names); untagged -> 'bt601'."""
    if tagged:
        t = tagged.lower().replace("-", "").replace("_", "")
        if "709" in t:
            return "bt709"
        if "601" in t or "470" in t or "170" in t or t in ("smpte170m", "bt470bg"):
            return "bt601"
    return "bt601"
