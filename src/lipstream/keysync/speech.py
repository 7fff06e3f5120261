"""KeySync's speech features: two 768-d tokens a video frame (50 Hz at 25 fps), HuBERT's for the keyframe
model and WavLM's for the interpolation model, computed as the reference inference computes them.

The speech is 16 kHz mono cut into 640-sample frames (the last padded with zeros). HuBERT reads the whole
utterance normalised to zero mean and unit variance, in pieces of at least 20 s; its 2F - 1 tokens get a
zero token appended. WavLM reads the raw samples, an even number of frames at a time (a zero frame
appended where odd), in pieces of at least 500 frames; each piece's 2f - 1 tokens are stretched to 2f by
nearest-neighbour. Either way the tokens are then paired, frame by frame.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SAMPLE_RATE = 16000
FRAME = 640  # samples a video frame at 25 fps
HUBERT_PIECE = SAMPLE_RATE * 20  # samples
WAVLM_PIECE = 500  # frames


def frames_of(samples: torch.Tensor) -> torch.Tensor:
    """[S] samples at 16 kHz -> [F, 640], the last frame padded with zeros."""
    frames = -(-samples.shape[0] // FRAME)
    return F.pad(samples, (0, frames * FRAME - samples.shape[0])).view(frames, FRAME)


def piece_sizes(total: int, least: int) -> list[int]:
    """Sizes of the pieces `total` is read in: one piece up to 2 * least - 1, else equal pieces and a last one
    of at least `least` (the reference's calculate_splits)."""
    if total <= least:
        return [total]
    count = (total - least) // least + 1
    sizes = [(total - least) // count] * (count - 1)
    sizes.append(total - sum(sizes))
    return sizes


def hubert_features(hubert: torch.nn.Module, frames: torch.Tensor) -> torch.Tensor:
    """[F, 640] samples -> [F, 2, 768] HuBERT tokens (the last frame's second one zero)."""
    audio = frames.flatten()
    audio = ((audio - audio.mean()) / torch.sqrt(audio.var() + 1e-7))[None]
    tokens = torch.cat([hubert(piece) for piece in torch.split(audio, piece_sizes(audio.shape[1], HUBERT_PIECE), 1)],
                       dim=1)
    if tokens.shape[1] % 2:
        tokens = torch.cat([tokens, torch.zeros_like(tokens[:, :1])], dim=1)
    return tokens[0].unflatten(0, (-1, 2))


def wavlm_features(wavlm: torch.nn.Module, frames: torch.Tensor) -> torch.Tensor:
    """[F, 640] samples -> [F', 2, 768] WavLM tokens, F' = F rounded up to even."""
    if frames.shape[0] % 2:
        frames = torch.cat([frames, frames.new_zeros(1, FRAME)])
    out = []
    for piece in torch.split(frames, piece_sizes(frames.shape[0], WAVLM_PIECE)):
        tokens = wavlm(piece.flatten()[None])  # [1, 2f - 1, C]
        tokens = F.interpolate(tokens.transpose(1, 2), size=2 * piece.shape[0], mode="nearest")
        out.append(tokens[0].transpose(0, 1).unflatten(0, (-1, 2)))
    return torch.cat(out)
