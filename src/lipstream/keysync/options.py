"""How KeySync samples: one options object (maths and speed) with named presets. Free of torch, so the CLI
checks a user's choices before anything heavy loads."""

from __future__ import annotations

from dataclasses import dataclass, replace

DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class KeySyncOptions:
    """`steps`: Euler steps over the noise table (10: its own 11 levels, as the reference; other counts: the
    table resampled log-linearly, as the reference does above 10). `guidance_until`: the noise level below
    which a step runs one UNet pass with every condition instead of three (0: every step guided, as the
    reference). `audio_scale`, `reference_scale`: the guidance (5 and 2 in the reference). `seed`: the noise
    (23 in the reference), drawn in the reference's order. `keyframe_dtype`, `interpolation_dtype`: the UNets'
    precision (the reference samples keyframes in fp32 and the frames between under fp16 autocast).
    `autocast`: reach it as the reference does (fp32 weights, products in the dtype, normalisations in
    fp32); False: a copy of the weights cast to it once (every operation in it; no casts a call). The VAE
    decodes in `decode_dtype` (fp32 in the reference). `clips_per_call`: 14-frame clips per UNet call (each call
    runs three guidance passes of them); only memory and speed depend on it. `chunk_clips`: keyframe clips a
    chunk (the reference's 2, about 13 s of frames before the first comes out; 1 halves that wait: the same
    clips and segments, the noise drawn in another order)."""

    steps: int = 10
    audio_scale: float = 5.0
    reference_scale: float = 2.0
    guidance_until: float = 0.0
    seed: int = 23
    keyframe_dtype: str = "float32"
    interpolation_dtype: str = "float16"
    autocast: bool = True
    decode_dtype: str = "float32"
    clips_per_call: int = 2
    chunk_clips: int = 2

    def check(self) -> None:
        """ValueError naming the field and what is allowed."""
        if self.steps < 4 or self.steps > 100:
            raise ValueError(f"steps {self.steps}: 4 to 100 are allowed (10: KeySync's own noise table)")
        if not 0.0 <= self.guidance_until <= 700.0:
            raise ValueError(f"guidance_until {self.guidance_until}: a noise level from 0 to 700 is allowed")
        for name in ("keyframe_dtype", "interpolation_dtype", "decode_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} {getattr(self, name)!r}: one of {', '.join(DTYPES)} is allowed")
        if not 1 <= self.clips_per_call <= 64:
            raise ValueError(f"clips_per_call {self.clips_per_call}: 1 to 64 are allowed")
        if not 1 <= self.chunk_clips <= 8:
            raise ValueError(f"chunk_clips {self.chunk_clips}: 1 to 8 are allowed")

    def for_device(self, device_type: str) -> KeySyncOptions:
        """On a CPU every network runs in fp32 (its half-precision kernels are slow or missing)."""
        if device_type == "cuda":
            return self
        return replace(self, keyframe_dtype="float32", interpolation_dtype="float32", decode_dtype="float32")

    def replace(self, **changes) -> KeySyncOptions:
        return replace(self, **changes)


KEYSYNC_PRESETS: dict[str, KeySyncOptions] = {
    # the reference inference's precision: keyframes in fp32, the frames between in fp16
    "reference": KeySyncOptions(),
    # both UNets' weights and the VAE's decoder in bf16 (a UNet call 5.6 ms a frame on the H100, against 7.3
    # under autocast), more clips a call, chunks of one keyframe clip (the first frames sooner)
    "fast": KeySyncOptions(keyframe_dtype="bfloat16", interpolation_dtype="bfloat16", autocast=False,
                           decode_dtype="bfloat16", clips_per_call=4, chunk_clips=1),
    # fast's precision with 14 UNet passes a frame instead of 33: 6 steps (the table resampled: 700, 15.9, 4.25,
    # 0.98, 0.17, 0.002), the last two unguided. Not the reference's maths: what it costs in fidelity is not
    # measured on the published weights
    "draft": KeySyncOptions(steps=6, guidance_until=0.5, keyframe_dtype="bfloat16", interpolation_dtype="bfloat16",
                            autocast=False, decode_dtype="bfloat16", clips_per_call=4, chunk_clips=1),
}
