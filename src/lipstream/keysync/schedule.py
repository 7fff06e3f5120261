"""Which frames KeySync generates how, as the reference inference schedules them.

Keyframes fall every 13 frames (0, 13, 26, ...) and are sampled by the keyframe model in clips of 14
slots: each clip starts with a slot standing for frame 0 (its speech, mask and latent; dropped after
sampling) and the last clip is filled up by repeating its last keyframe (dropped too). The frames between
two neighbouring keyframes are sampled by the interpolation model as a 14-frame segment whose ends are the
two keyframes. Work goes in chunks of two keyframe clips, each chunk's segments after its keyframes, the
previous chunk's last keyframe carried over as the first segment's start. Frames after the last whole
segment are not generated: a clip of F frames gives 1 + 13 * ((F - 1) // 13).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CLIP = 14  # frames a clip of either model
STEP = CLIP - 1  # keyframes apart; segments share their end frames
CHUNK = 2  # keyframe clips a chunk


@dataclass(frozen=True)
class Slot:
    frame: int  # whose speech, mask and latent the slot is sampled with
    kept: bool  # a keyframe of the output; False: the frame-0 slot or filling


@dataclass(frozen=True)
class Chunk:
    clips: tuple[tuple[Slot, ...], ...]  # keyframe clips, CLIP slots each
    segments: tuple[tuple[int, int], ...]  # (first, last) frame of each interpolation segment


@dataclass(frozen=True)
class Schedule:
    frames: int  # generated: 1 + STEP * segments
    chunks: tuple[Chunk, ...]

    @property
    def segments(self) -> list[tuple[int, int]]:
        return [s for c in self.chunks for s in c.segments]


def plan(frames: int, chunk: int = CHUNK) -> Schedule:
    """The schedule for `frames` input frames (at least CLIP), `chunk` keyframe clips a chunk (the reference's
    2; 1 brings the first frames sooner: the same clips and segments, the noise drawn in another order)."""
    if frames < CLIP:
        raise ValueError(f"KeySync needs at least {CLIP} frames, not {frames}")
    starts = range(0, frames - CLIP + 1, STEP)
    segments = [(i, i + STEP) for i in starts]
    keys = [0] + [last for _, last in segments]
    slots: list[Slot | None] = [Slot(k, True) for k in keys]
    # the reference's add_zero_flag: a frame-0 slot at every multiple of CLIP, counted over the list as it grows
    for i in range(0, len(slots) + (len(slots) + 1) % CLIP, CLIP):
        slots.insert(i, Slot(0, False))
    slots += [Slot(slots[-1].frame, False)] * ((CLIP - len(slots) % CLIP) % CLIP)
    clips = [tuple(slots[i:i + CLIP]) for i in range(0, len(slots), CLIP)]
    chunks, carried = [], None
    for c in range(0, len(clips), chunk):
        own = [s for clip in clips[c:c + chunk] for s in clip]
        kept = [s.frame for s in ([carried] if carried else []) + own if s.kept]
        carried = own[-1]
        segs = tuple((a, b) for a, b in segments if kept and a >= kept[0] and b <= kept[-1])
        if not segs:  # only the last keyframe, carried over: nothing left to interpolate
            break
        chunks.append(Chunk(tuple(clips[c:c + chunk]), segs))
    return Schedule(1 + STEP * len(segments), tuple(chunks))


def box_masks(landmarks: np.ndarray, size: int = 512, latent: int = 64, nose: int = 28) -> np.ndarray:
    """[F, 68, 2] landmarks in a size x size crop -> [F, latent, latent] float32 masks of the generated region:
    from the leftmost to the rightmost landmark, from the nose bridge point (68-point index 28) down to the
    bottom, as the reference draws it at `size` (integer corners, inclusive) and samples every
    size/latent-th pixel (nearest)."""
    points = np.asarray(landmarks, dtype=np.float64).astype(np.int64)  # the reference's scale_landmarks
    step = size // latent
    grid = np.arange(latent) * step
    x0, x1 = points[:, :, 0].min(1), points[:, :, 0].max(1)
    top = points[:, nose, 1]
    inside_x = (grid[None, :] >= x0[:, None]) & (grid[None, :] <= x1[:, None])
    inside_y = grid[None, :] >= top[:, None]
    return (inside_y[:, :, None] & inside_x[:, None, :]).astype(np.float32)
