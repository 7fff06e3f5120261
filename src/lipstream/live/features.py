"""Whisper features while the audio is still arriving: a rolling window per utterance, batched.

Offline, Whisper-tiny's encoder sees 30 s segments and attends both ways, so a feature step
depends on audio far ahead of it. Live, a step is final once `lookahead_steps` (20 ms each) of
audio past it are in: each window holds `context_steps` of left context, `hop_steps` new steps
and the look-ahead, always the same length, so the windows of every session go through the
encoder as one batch. The encoder runs on the window's steps only (its positional embeddings
taken at the steps' places in an offline 30 s segment), not on 1500 padded positions: a 1.1 s
window costs a twenty-fifth of a segment. The log-mel is the offline one frame for frame (the
window carries 200 samples of margin each side instead of the STFT's reflect padding); its
normalisation uses the peak of the utterance so far, where offline uses the whole segment's.
docs/BENCHMARKS.md ("Streaming features") measures what each choice costs against offline.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from lipstream.audio.features import _window_and_filters, whisper_features
from lipstream.audio.windows import audio_windows
from lipstream.engine.graphs import IndexRing
from lipstream.models.config import (
    AUDIO_DIM, FEATURES_PER_SEGMENT, HIDDEN_STATES, HOP_LENGTH, N_FFT, SAMPLE_RATE, SAMPLES_PER_FEATURE, WINDOW_STEPS)

if TYPE_CHECKING:
    from lipstream.models import MuseTalk

log = logging.getLogger(__name__)
BATCHES = (1, 2, 4, 8, 16, 32, 64)  # windows per encoder call, padded up
CPU_WARM_BATCH = 16
MARGIN = N_FFT // 2  # samples each side of a window: its first and last mel frames see real audio


@dataclass
class WindowJob:
    """One window to encode: `audio` covers steps [first, first + W) plus MARGIN samples each side."""

    audio: np.ndarray
    first: int  # the window's first step in its utterance (negative: before the speech, zeros)
    peak: int  # the utterance's running log-mel peak lives at this index of FeatureTable.peaks
    reset_peak: bool  # the utterance's first window
    rows: list[int]  # table rows of the window's hop steps


class FeatureTable:
    """Every session's recent features on the device: a ring of `ring_steps` rows per session (`rings`
    of them), one zero row (steps outside an utterance read it) and the 10 rows of the idle window."""

    def __init__(self, rings: int, ring_steps: int, device: torch.device, dtype: torch.dtype):
        self.ring_steps = ring_steps
        self.table = torch.zeros(rings * ring_steps + 1 + WINDOW_STEPS, HIDDEN_STATES, AUDIO_DIM, device=device,
                                 dtype=dtype)
        self.zero = rings * ring_steps
        self.idle = list(range(self.zero + 1, self.zero + 1 + WINDOW_STEPS))
        self.peaks = torch.full((rings + 1,), -10.0, device=device)  # one per ring, and a spare for padding
        self.spare = rings

    def row(self, ring: int, step: int) -> int:
        return ring * self.ring_steps + step % self.ring_steps


class StreamingWhisper:
    """Encodes batches of fixed-length windows into a FeatureTable (the GPU side of streaming features)."""

    def __init__(self, models: MuseTalk, table: FeatureTable, context: int, hop: int, lookahead: int,
                 trace: bool = True):
        self.models, self.encoder, self.table = models, models.whisper, table
        self.context, self.hop, self.lookahead = context, hop, lookahead
        self.steps = context + hop + lookahead  # W
        self.samples = self.steps * SAMPLES_PER_FEATURE + 2 * MARGIN
        p = next(self.encoder.parameters())
        self.device, self.dtype = p.device, p.dtype
        cuda = self.device.type == "cuda"
        # fixed batch shapes: on a GPU kernel choices are per shape; traced, each shape is a trace (100-200 ms
        # on a CPU), which a first session would wait for. Eager on a CPU, padding would only cost.
        self.pad = cuda or trace
        self._host = [torch.empty(BATCHES[-1], self.samples, pin_memory=cuda) for _ in range(4)]  # pinned: uploads never block
        self._k = 0
        self._events = [torch.cuda.Event() if cuda else None for _ in self._host]
        self._ints = IndexRing(self.device)
        window, filters = _window_and_filters(self.device, models.mel_filters.astype(np.float64).tobytes())
        self._math = WindowFeatures(self.encoder, window, filters, torch.arange(self.steps, device=self.device),
                                    self.dtype)
        self.trace = trace
        self._traced: dict[int, Callable[..., torch.Tensor]] = {}  # by batch size

    def _call(self, b: int) -> Callable[..., torch.Tensor]:
        """The encoder call for a batch of b: traced once per size (its ops then run without the GIL); the
        sizes are the padded BATCHES, traced at warm-up."""
        if not self.trace:
            return self._math
        traced = self._traced.get(b)
        if traced is None:
            example = (torch.zeros(b, self.samples, device=self.device), self.table.peaks.clone(),
                       torch.full((b,), self.table.spare, device=self.device), torch.zeros(b, dtype=torch.long,
                                                                                          device=self.device))
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # TorchScript is deprecated; it is here for its GIL-free calls
                    traced = torch.jit.trace(self._math, example, check_trace=False)
            except Exception as e:  # noqa: BLE001 - a torch without TorchScript: the eager ops, slower under load
                log.warning("streaming Whisper runs eager (tracing failed: %s)", str(e).splitlines()[0])
                self.trace = False
                return self._math
            traced = self._traced[b] = functools.partial(_untuned, traced)
        return traced

    @torch.inference_mode()
    def idle_window(self) -> None:
        """The mouth at rest: the window in the middle of a second of silence, as offline crossfades use."""
        quiet = whisper_features(torch.zeros(SAMPLE_RATE, device=self.device), self.models)
        window = audio_windows(quiet, 25)[12].reshape(WINDOW_STEPS, HIDDEN_STATES, AUDIO_DIM)
        self.table.table[self.table.idle] = window.to(self.table.table.dtype)

    @torch.inference_mode()
    def run(self, jobs: list[WindowJob]) -> int:
        """Encode these windows and write their hop steps into the table (queued on the current stream);
        how many encoder calls that took."""
        for start in range(0, len(jobs), BATCHES[-1]):
            self._run(jobs[start:start + BATCHES[-1]])
        return -(-len(jobs) // BATCHES[-1])

    @torch.inference_mode()
    def warm(self) -> None:
        """Run every batch size once now: a first call per shape costs tens of ms (kernel choices) or a
        trace. On a CPU up to CPU_WARM_BATCH (a CPU serves a few sessions; a larger shape traces when
        it first comes)."""
        if not self.pad:
            return
        for b in [x for x in BATCHES if self.device.type == "cuda" or x <= CPU_WARM_BATCH]:
            self._run([WindowJob(np.zeros(self.samples, np.float32), 0, self.table.spare, False, [])] * b)

    def _run(self, jobs: list[WindowJob]) -> None:
        """One encoder call, padded to a fixed batch size (a few shapes, all warmed at start)."""
        n = len(jobs)
        b = next(x for x in BATCHES if x >= n) if self.pad else n
        jobs = jobs + [WindowJob(jobs[0].audio, 0, self.table.spare, False, [])] * (b - n)  # pads: no rows
        k = self._k
        self._k = (k + 1) % len(self._host)
        host = self._host[k]
        if self._events[k] is not None:
            self._events[k].synchronize()  # the upload that last read this buffer is done (long ago)
        np.stack([job.audio for job in jobs], out=host.numpy()[:b])  # one copy: each drops and retakes the GIL
        audio = host[:b].to(self.device, non_blocking=True)
        if self._events[k] is not None:
            self._events[k].record()
        up = self._ints.upload
        peaks = up([j.peak for j in jobs])
        resets = [j.peak for j in jobs if j.reset_peak]
        if resets:
            self.table.peaks[up(resets)] = -10.0
        first = up([j.first for j in jobs])
        states = self._call(b)(audio, self.table.peaks, peaks, first)  # [b, W, 5, 384]
        new = states[:n, self.context:self.context + self.hop].reshape(-1, HIDDEN_STATES, AUDIO_DIM)
        real = [r for j in jobs[:n] for r in j.rows]
        if real:
            self.table.table.index_copy_(0, up(real), new.to(self.table.table.dtype))


def _untuned(traced: torch.jit.ScriptModule, *args) -> torch.Tensor:
    with torch.jit.optimized_execution(False):  # the traced ops as they are: no fusion passes, no numerics change
        return traced(*args)


class WindowFeatures(torch.nn.Module):
    """An encoder call's maths, samples to hidden states: log-mel (the offline one, frame for frame),
    normalised by each utterance's running peak (`peaks`, updated in place), the encoder on the
    window's steps. One module so that it can be traced: a traced call drops the GIL once where
    the eager ops drop and retake it at each op, and retaking it waits on the event loop
    (bench/gil_convoy.py, 2 cores, beside one busy thread: 725 ms eager, 129 ms traced)."""

    def __init__(self, encoder, window: torch.Tensor, filters: torch.Tensor, offsets: torch.Tensor,
                 dtype: torch.dtype):
        super().__init__()
        self.encoder, self.dtype = encoder, dtype
        self.register_buffer("window", window, persistent=False)
        self.register_buffer("filters", filters, persistent=False)
        self.register_buffer("offsets", offsets, persistent=False)

    def forward(self, audio: torch.Tensor, peaks: torch.Tensor, index: torch.Tensor,
                first: torch.Tensor) -> torch.Tensor:
        stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=self.window, center=False, return_complex=True)
        mel = torch.clamp(self.filters @ stft[..., :-1].abs().square(), min=1e-10).log10()  # [b, 80, 2W]
        peaks.scatter_reduce_(0, index, mel.amax(dim=(1, 2)), "amax")
        mel = (torch.maximum(mel, peaks[index][:, None, None] - 8.0) + 4.0) / 4.0
        positions = (first[:, None] + self.offsets) % FEATURES_PER_SEGMENT
        return self.encoder(mel.to(self.dtype), positions)


def streamed_features(models: MuseTalk, audio: np.ndarray, context: int, hop: int, lookahead: int) -> torch.Tensor:
    """[T, 5, 384]: the features a live session computes for this utterance (16 kHz), window by
    window in arrival order; for comparing against the offline features of the same audio."""
    p = next(models.whisper.parameters())
    table = FeatureTable(1, max(64, audio.size // SAMPLES_PER_FEATURE + 2 * WINDOW_STEPS), p.device, p.dtype)
    sw = StreamingWhisper(models, table, context, hop, lookahead)
    steps = max(1, audio.size // SAMPLES_PER_FEATURE)
    f = 0
    while f < steps:
        lo = (f - context) * SAMPLES_PER_FEATURE - MARGIN
        window = np.zeros(sw.samples, np.float32)
        a, b = max(0, lo), min(audio.size, lo + window.size)
        window[a - lo:b - lo] = audio[a:b]
        sw.run([WindowJob(window, f - context, 0, f == 0, [table.row(0, f + i) for i in range(hop)])])
        f += hop
    return table.table[:steps].clone()
