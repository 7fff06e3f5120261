"""How the engine computes frames: one options object (maths and speed) with named presets.

Kept free of torch: the CLI checks a user's options with these before anything heavy is imported.
A render's options (the output's, around these) are render/options.py's; the live engine's, live/options.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from lipstream.models.config import UPSAMPLE_MODES

DECODE_ROWS = ("auto", "full", "mask")  # engine/decode.py: which face rows the VAE decodes
DECODE_STATS = ("rows", "near")  # engine/decode.py: what a cropped decode's GroupNorms see
INDUCTOR_MODES = ("off", "vae", "all")  # torch.compile of the uncompiled networks' step
CAPTURE_MODES = ("before", "later")  # a one-shot render's CUDA graphs: before its first frame, or in the loop
DEFAULT_DECODE_ROW = 8  # latent row the cropped decode starts at (64 of 256 px)
MAX_BATCH = 256


@dataclass(frozen=True)
class EngineOptions:
    """How the engine computes frames. `batch`: frames per step (the largest captured bucket; None: 32 on a
    GPU, 16 on a CPU), with a `first_batch` bucket so a render's first frames come sooner (None: 16 on a GPU,
    where a one-shot render often stays on it to the end, 8 on a CPU). `decode_rows` "auto" decodes only the
    face rows the blend uses (from latent row `decode_row`, the cut rows' GroupNorm statistics as
    `decode_stats` says) for avatars whose mask allows it, "full" the whole face (exact), "mask" refuses
    avatars it cannot crop. `upsample`: "transpose" fuses each nearest-upsample + 3x3 conv into one
    transposed conv (exact, fewer FLOPs), "phases" into four phase convs, "plain" keeps the modules.
    `inductor`: torch.compile of the uncompiled networks' step ("vae": the decoder, "all": UNet too).
    `graphs`: CUDA graphs (None: on a GPU). `capture`: when a one-shot render captures them: "before" its
    first frame for the first batch's bucket (the others in the render loop), or "later": the first batch
    runs uncaptured and every bucket is captured in the loop (a package's direct call may cost less than a
    capture: a finished study in docs/BENCHMARKS.md decided). `reference`: the plain eager fp32 path with a numpy
    blend, slow on purpose: the fast path is checked against it."""

    batch: int | None = None
    first_batch: int | None = None
    decode_rows: str = "auto"
    decode_row: int = DEFAULT_DECODE_ROW
    decode_stats: str = "rows"
    upsample: str = "transpose"
    inductor: str = "off"
    graphs: bool | None = None
    capture: str = "before"
    reference: bool = False

    def check(self) -> None:
        """ValueError naming the field and what is allowed."""
        if (self.batch is not None and not 1 <= self.batch <= MAX_BATCH
                or self.first_batch is not None and not 1 <= self.first_batch <= MAX_BATCH):
            raise ValueError(f"batch {self.batch}, first_batch {self.first_batch}: 1 to {MAX_BATCH} are allowed")
        for name, value, allowed in (("decode_rows", self.decode_rows, DECODE_ROWS),
                                     ("decode_stats", self.decode_stats, DECODE_STATS),
                                     ("upsample", self.upsample, UPSAMPLE_MODES),
                                     ("inductor", self.inductor, INDUCTOR_MODES),
                                     ("capture", self.capture, CAPTURE_MODES)):
            if value not in allowed:
                raise ValueError(f"{name} {value!r}: one of {', '.join(allowed)} is allowed")
        if not 0 <= self.decode_row < 32:
            raise ValueError(f"decode_row {self.decode_row}: a latent row from 0 to 31 is allowed")

    def for_device(self, device_type: str) -> EngineOptions:
        """The batches left open, chosen for the device: on a GPU a large batch fills it, on a CPU the
        networks are the bottleneck and a smaller one brings the first frame sooner. The GPU's first bucket
        is 16: a one-shot render that would not repay the full bucket's capture renders on it to the end
        (render_loop.later_capture_pays), and on the H100 its step makes 485 frames/s against 8's 400
        (`lipstream serve`'s measured steps, 2026-12-05), for 13 ms more before the first frame."""
        gpu = device_type == "cuda"
        out = self if self.batch is not None else replace(self, batch=32 if gpu else 16)
        return out if out.first_batch is not None else replace(out, first_batch=16 if gpu else 8)

    @property
    def buckets(self) -> tuple[int, ...]:
        """The batch sizes captured: the first batch's and the full one."""
        batch = self.batch or 16
        return tuple(sorted({min(self.first_batch or 8, batch), batch}))

    def replace(self, **changes) -> EngineOptions:
        return replace(self, **changes)


ENGINE_PRESETS: dict[str, EngineOptions] = {
    # the defaults: mask-rows decode, fused upsamplers (625 fps core on the H200, 45.9 dB worst frame)
    "fast": EngineOptions(),
    # the exact network maths in the engine's dtype (the whole face decoded: 527 fps on the H200)
    "exact": EngineOptions(decode_rows="full"),
    # the plain eager fp32 path and a numpy blend: what the others are checked against
    "reference": EngineOptions(decode_rows="full", upsample="plain", graphs=False, reference=True),
}
