"""What a live engine does and how fast: one options object, with named presets.

Everything that trades latency, accuracy and GPU time lives here; the engine, the scheduler and
the sessions read it and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

FEATURE_MODES = ("stream", "utterance")
WINDOW_AHEAD_STEPS = 6  # a frame's window: 4 feature steps before its start, 6 from it (audio/windows.py)


@dataclass(frozen=True)
class LiveOptions:
    """`playout_delay_s`: how far behind the wall clock a session plays (speech pushed at t plays at
    t + delay); a frame not ready by then is late. `features`: "stream" computes Whisper features over
    a rolling window as audio arrives (`context_s` of left context, `lookahead_steps` of 20 ms past
    what the MuseTalk window needs, `hop_steps` finalised per window); "utterance" waits for the end
    of each utterance and computes them over the whole of it, exactly as an offline render does.
    `buckets`: the batch sizes captured per step, a step padded up to the next. Under load a step takes
    the frames that became ready while the one before it ran, so its size follows its own length: with
    only 8 and 16 (H100, compiled: 19.7 and 32.8 ms), 16 low-latency sessions (400 frames/s) overflow 8,
    fall into padded 16s of 33 ms, and a frame waits one step and runs in the next, past its 120 ms.
    Admission refuses a session when the sessions' frame rates would pass `utilisation` of `capacity_fps`
    (None: measured at warm-up; then also of what the steps short enough for the session closest to the
    speech make, scheduler.step_budget_s).
    `encode`: H.264 (`x264_preset`, `crf`, a keyframe every `gop_s`) + `audio_codec` per session.
    `fill_slack_s`: a step with room left waits for more frames while every frame in it still has
    more than this before its deadline: fuller steps and fewer GPU-seconds a frame, for more
    latency (0: launch at once; on the H200 at 24 sessions 0.1 s took GPU busy from 90% to 74%
    and p99 from 258 to 276 ms).
    `feature_tick_s`: Whisper runs at most this often, over every session's windows ready by then
    (the first after a quiet spell at once): clients' 20 ms chunks arrive out of phase, and without
    it a small encoder call at nearly every turn of the core thread took 77% of that thread on the
    H200 at 16 sessions (GPU 15% busy, frames late); at most this much more latency.
    `trace_whisper`: the streaming Whisper call runs traced (TorchScript), its ops without the GIL;
    eager, each op gives the GIL up and waits to get it back from whatever Python runs beside
    (`lipstream serve`'s event loop): 725 against 129 ms beside one busy thread on 2 CPU cores
    (bench/gil_convoy.py); on the H200 a traced 2.6 ms call still took 273 ms beside one, which is why
    `lipstream serve` runs aiortc in processes of its own (serve/rtc.py).
    `idle_cache_gib`: the idle loop of each avatar (every loop frame with the mouth at rest) is
    rendered once and kept in host memory, up to this much over all avatars, so silent sessions
    cost no GPU time; 0 renders every idle frame in the steps.
    `window_ahead_steps`: how much of a frame's window past its start (20 ms steps; 6: all of it,
    120 ms) a speech frame waits for. Fewer renders it sooner, the steps not in yet repeating the
    last one that is: the mouth does not see the next 80 ms coming (docs/live.md, "Low latency").
    """

    playout_delay_s: float = 0.25
    features: str = "stream"
    context_s: float = 1.0
    lookahead_steps: int = 0
    hop_steps: int = 1
    # on the H200 a compiled 16 runs as many frames/s as 32, in half the time; 6, 10 and 12 are there so a
    # loaded engine's steps need not pad up to 8 or 16 (below)
    buckets: tuple[int, ...] = (1, 2, 4, 6, 8, 10, 12, 16)
    max_sessions: int = 64
    ring_steps: int = 1536  # feature steps kept per session (30.7 s): a longer utterance streams through it
    utilisation: float = 0.95
    capacity_fps: float | None = None
    encode: bool = True
    x264_preset: str = "ultrafast"
    crf: int = 23
    gop_s: float = 1.0
    audio_codec: str = "opus"
    idle_cache_gib: float = 8.0
    fill_slack_s: float = 0.0
    feature_tick_s: float = 0.02
    trace_whisper: bool = True
    window_ahead_steps: int = WINDOW_AHEAD_STEPS

    def __post_init__(self) -> None:
        if self.features not in FEATURE_MODES:
            raise ValueError(f"features must be one of {FEATURE_MODES}, not {self.features!r}")
        if self.fill_slack_s < 0:
            raise ValueError("fill_slack_s must be >= 0")
        if not 0 <= self.feature_tick_s <= 0.5:
            raise ValueError("feature_tick_s must be 0 to 0.5 s")
        if self.idle_cache_gib < 0:
            raise ValueError("idle_cache_gib must be >= 0")
        if self.playout_delay_s <= 0 or self.context_s < 0 or self.lookahead_steps < 0 or self.hop_steps < 1:
            raise ValueError("playout_delay_s > 0, context_s >= 0, lookahead_steps >= 0 and hop_steps >= 1 are required")
        if not 0 <= self.window_ahead_steps <= WINDOW_AHEAD_STEPS:
            raise ValueError(f"window_ahead_steps must be 0 to {WINDOW_AHEAD_STEPS}")
        if not self.buckets or min(self.buckets) < 1:
            raise ValueError("buckets must be batch sizes >= 1")

    @property
    def context_steps(self) -> int:
        return round(self.context_s * 50)

    def replace(self, **changes) -> LiveOptions:
        return replace(self, **changes)


PRESETS: dict[str, LiveOptions] = {
    # p99 <= 250 ms from sample to encoded frame: the window's own 120 ms look-ahead and no more
    "realtime": LiveOptions(),
    # speech to mouth at the client in about 150 ms: 120 ms behind the speech, a frame rendered once its
    # own 40 ms of audio is in (not the window's 120 ms), Whisper every 10 ms
    "lowlatency": LiveOptions(playout_delay_s=0.12, window_ahead_steps=2, feature_tick_s=0.01),
    # more context and 80 ms of Whisper look-ahead: closer to the offline features, 80 ms later
    "accurate": LiveOptions(playout_delay_s=0.35, context_s=2.0, lookahead_steps=4),
    # whole utterances (a TTS that hands over complete sentences): the offline features exactly
    "utterance": LiveOptions(playout_delay_s=1.0, features="utterance"),
    # a machine without a GPU: Whisper every 200 ms over 0.5 s of context (5 runs a second, not 50)
    # and 1 s behind the speech, so a 2-core CPU keeps a small presenter on time; steps of at most 4
    # frames (a CPU runs no more frames/s at 16, and measuring the 16-frame step at start takes 30 s)
    "cpu": LiveOptions(playout_delay_s=1.0, context_s=0.5, hop_steps=10, buckets=(1, 2, 4)),
}


# what a session may choose on any engine (open_session(latency=...)): its own fields of a preset
# (a low session's feature tick is the engine's while it is open: the core runs Whisper at the shortest asked)
SESSION_LATENCY = {"default": {}, "low": {"playout_delay_s": PRESETS["lowlatency"].playout_delay_s,
                                          "window_ahead_steps": PRESETS["lowlatency"].window_ahead_steps,
                                          "feature_tick_s": PRESETS["lowlatency"].feature_tick_s}}


def preset(name: str) -> LiveOptions:
    if name not in PRESETS:
        raise ValueError(f"unknown live preset {name!r}; choose from {sorted(PRESETS)}")
    return PRESETS[name]
