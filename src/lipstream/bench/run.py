"""Run the scenarios in each mode and write the report (terminal table, JSON, markdown)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
from fractions import Fraction
from pathlib import Path

from collections.abc import Callable
from dataclasses import dataclass, field

import av
import numpy as np
import torch

from lipstream.audio.windows import audio_windows, audio_windows_loop
from lipstream.avatar import load_avatar, ping_pong
from lipstream.bench import figures, legacy, scenarios
from lipstream.bench.engines import CPUBlendEngine, RGBEngine, RGBToI420Writer
from lipstream.engine.interface import FrameEngine
from lipstream.engine.engines import FAST_INDUCTOR, ModuleEngine
from lipstream.media.mp4 import MP4Writer
from lipstream.models import MuseTalk
from lipstream.engine.options import ENGINE_PRESETS, EngineOptions
from lipstream.render.options import RenderOptions
from lipstream.avatar.folders import resolve_avatar
from lipstream.media.rates import AUDIO_RATE
from lipstream.render.program import load_speech, prepare, render_program, write

PRESET = "ultrafast"  # x264 preset of the fast rows (the legacy rows keep upstream's veryfast-like settings)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


FAST_BATCH = 32


@dataclass(frozen=True)
class Variant:
    """How one row renders: its engine (built and warmed once per key), the options it changes and the
    pieces of the render it swaps in (render.prepare's window builder, render_loop.write's writer)."""

    engine_key: str = "fast"
    make_engine: Callable[[MuseTalk], FrameEngine] | None = None
    options: dict = field(default_factory=dict)
    windows: Callable = audio_windows
    writer: Callable = MP4Writer


def run(models: MuseTalk, out: Path, *, width: int, height: int, scale: float = 1.0,
        modes: tuple[str, ...] = ("legacy", "fast"), compile: bool = False,
        only: tuple[str, ...] | None = None, command: str | None = None) -> dict:
    """Every scenario in every mode; returns (and writes) the report.

    Fast rows run after a warm start, as a service would: each configuration's engine is built,
    compiled and captured once (its startup is reported separately), warmed on a one-second
    program, then timed on the scenario. The legacy mode needs no warm-up (eager, no compile).
    `only`: run just these scenarios ("A", "B") and keep the other scenarios' rows of a report
    already in `out` (so a long bench can be split across calls, e.g. on a time-limited GPU).
    """
    inductor = FAST_INDUCTOR if compile else "off"
    out.mkdir(parents=True, exist_ok=True)
    work = out / "work"
    t = time.perf_counter()
    built = scenarios.build(work, models, width=width, height=height, scale=scale)
    kept: list[dict] = []
    startup: dict[str, dict] = {}
    built = [b for b in built if not only or b.name in only]
    call = ",".join(b.name for b in built)  # this call's startup is kept apart from earlier calls'
    if only:
        previous = out / "bench.json"
        if previous.is_file():
            earlier = json.loads(previous.read_text())
            kept = [r for r in earlier.get("rows", []) if r["scenario"] not in only]
            startup = {k: v for k, v in earlier.get("startup", {}).items() if k != call and isinstance(v, dict)}
    startup[call] = {}
    report = {"date": time.strftime("%Y-%m-%d"), "device": _device_name(models.device),
              "commit": _commit(), "command": command, "size": f"{width}x{height}", "scale": scale, "weights": models.source,
              "compile": inductor, "batch": FAST_BATCH, "preset": PRESET, "cpus": os.cpu_count(),
              "setup_s": time.perf_counter() - t, "startup": startup, "rows": list(kept)}
    references = {}
    for scenario in built:  # the eager fp32 reference, lossless: the PSNR column compares against it
        ref_models = models if models.dtype == torch.float32 else None
        references[scenario.name] = out / "work" / f"{scenario.name}-reference.mp4"
        render_program(scenario.program, references[scenario.name], ref_models or _fp32(models),
                       RenderOptions(ENGINE_PRESETS["reference"], crf=0, progress=False))
    warm_program = scenarios.warm_up_program(work, built)
    runs = [m for m in modes if m not in ("ablation", "oneshot")]
    variants = {"fast": Variant(), **{f"fast -{name}": v for name, v in ablations(inductor).items()}}
    if "ablation" in modes:
        runs += [f"fast -{name}" for name in ablations(inductor)]
    engines: dict[str, FrameEngine] = {}
    fast = RenderOptions(EngineOptions(batch=FAST_BATCH, inductor=inductor), x264_preset=PRESET, progress=False)

    def render(program, output: Path, variant: Variant):
        """The render with this row's engine and pieces."""
        options = fast.replace(**variant.options).for_machine(models.device.type, os.cpu_count() or 1)
        plan = prepare(program, models, engines[variant.engine_key], options, windows=variant.windows)
        engines[variant.engine_key].warm_up()  # every bucket for these avatars: a warm engine's full batches
        return write(plan, output, options, writer=variant.writer)

    def build(variant: Variant) -> None:
        """The row's engine, built, compiled, captured and warmed on a short program (once per engine)."""
        if variant.engine_key not in engines:
            t = time.perf_counter()
            engines[variant.engine_key] = (variant.make_engine or (lambda m: ModuleEngine(m, fast.engine)))(models)
            render(warm_program, work / "warm.mp4", variant)
            report["startup"][call][variant.engine_key] = time.perf_counter() - t

    for scenario in built:
        for mode in runs:
            output = out / f"{scenario.name}-{mode.replace(' ', '').replace('-', '_')}.mp4"
            if mode == "legacy":
                _reset_peak(models.device)
                row = legacy.render_legacy(scenario.program, output, models)
            else:
                variant = variants[mode]
                build(variant)
                _reset_peak(models.device)
                r = render(scenario.program, output, variant)
                row = {"frames": r.frames, "wall_s": r.wall_s, "fps": r.render_fps, "first_frame_s": r.first_frame_s,
                       "disk_bytes_written": r.disk_bytes_written, "timings": r.timings}
            row.update(scenario=scenario.name, mode=mode, description=scenario.description,
                       peak_gpu_gib=_peak_gib(models.device), output_bytes=output.stat().st_size,
                       psnr_db=face_psnr(output, references[scenario.name], scenario))
            report["rows"].append(row)
            print(f"bench {scenario.name} {mode}: {row['fps']:.1f} fps, {row['wall_s']:.2f} s", flush=True)
            (out / "bench.json").write_text(json.dumps(report, indent=2))  # partial results survive a time limit
    engines.clear()
    if "oneshot" in modes:
        for scenario in built:
            for mode, fresh in (("one-shot, nothing cached", True), ("one-shot, warm", False)):
                output = out / f"{scenario.name}-{'oneshot_cold' if fresh else 'oneshot_warm'}.mp4"
                row = oneshot(scenario, output, work, models, fresh_cache=fresh)
                row.update(scenario=scenario.name, mode=mode, description=scenario.description,
                           output_bytes=output.stat().st_size, psnr_db=face_psnr(output, references[scenario.name],
                                                                                 scenario))
                report["rows"].append(row)
                print(f"bench {scenario.name} {mode}: {row['wall_s']:.2f} s process wall", flush=True)
                (out / "bench.json").write_text(json.dumps(report, indent=2))
    report["rows"].sort(key=lambda r: r["scenario"])
    for row in report["rows"]:
        base = next((r for r in report["rows"] if r["scenario"] == row["scenario"] and r["mode"] == "legacy"), None)
        row["speedup"] = base["wall_s"] / row["wall_s"] if base else None
    chart = figures.fps_chart(report, out / "bench_fps.png")
    report["chart"] = chart.name if chart else None
    if chart is None:
        print(f"bench: {figures.NO_CHART}", flush=True)
    if "legacy" in modes and "fast" in modes:
        for scenario in built:
            avatar = load_avatar(resolve_avatar(scenario.program.scenes[0].shots[0].avatar,
                                                scenario.program.avatars_dir), with_frames=False)
            at = min(2.0, scenario.seconds / 2)
            box = avatar.boxes[ping_pong(int(at * float(avatar.fps)), avatar.num_frames)].tolist()
            figures.freeze_frames(out / f"{scenario.name}-legacy.mp4", out / f"{scenario.name}-fast.mp4",
                                  box, out / f"freeze_{scenario.name}.png", at)
    report["freeze_frames"] = sorted(p.name for p in [*out.glob("freeze_*.png"), *out.glob("freeze_*.jpg")])
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    (out / "bench.md").write_text(markdown(report))
    shutil.rmtree(work, ignore_errors=True)
    return report


def script_yaml(program) -> str:
    """A scenario's program as a broadcast script (render/script.py's format), for the one-shot rows."""
    lines = []
    if program.fps:
        lines.append(f"fps: {program.fps}")
    if program.avatars_dir:
        lines.append(f"avatars: {Path(program.avatars_dir).resolve()}")
    lines.append("scenes:")
    for scene in program.scenes:
        lines.append(f"  - audio: {Path(scene.audio).resolve()}")
        lines.append("    cameras:")
        lines += [f"      - {{at: {shot.at}, avatar: {shot.avatar}}}" for shot in scene.shots]
        if scene.start_frame:
            lines.append(f"    start_frame: {scene.start_frame}")
        if scene.crossfade:
            lines.append(f"    transition: {{crossfade: {scene.crossfade}}}")
    return "\n".join(lines) + "\n"


def oneshot(scenario: scenarios.Scenario, output: Path, work: Path, models: MuseTalk, *,
            fresh_cache: bool) -> dict:
    """What a user waits for: one `lipstream broadcast` process with default flags, from its start to the MP4.

    `fresh_cache`: empty cache folders (nothing compiled, no Inductor kernels: a new machine);
    otherwise the machine's own cache, after a first run that is not timed (a second run).
    """
    import re
    import subprocess
    import sys

    script = work / f"{scenario.name}.yaml"
    script.write_text(script_yaml(scenario.program))
    cmd = [sys.executable, "-m", "lipstream", "broadcast", str(script), "-o", str(output), "--timings",
           "--device", str(models.device.type)]
    if models.random_weights:
        cmd += ["--random-weights", "--random-size", models.config.name]
    else:
        cmd += ["--models", models.source]
    env = {**os.environ, "COLUMNS": "200"}
    if fresh_cache:
        cache = work / "fresh-cache"
        shutil.rmtree(cache, ignore_errors=True)
        env.update(LIPSTREAM_CACHE=str(cache), TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"))
    else:
        subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)  # the first run on the machine
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"one-shot {scenario.name} failed ({p.returncode}): {p.stderr[-800:]}")
    frames = int(re.search(r"(\d+) frames at", p.stdout).group(1))
    first = float(re.search(r"first encoded packet ([\d.]+) s after it started", p.stdout).group(1))
    engine = re.search(r"^(\w+ engine): .*$", p.stderr, re.M)
    return {"frames": frames, "wall_s": wall, "fps": frames / wall, "first_frame_s": first, "disk_bytes_written": 0,
            "peak_gpu_gib": float("nan"), "engine": engine.group(0) if engine else None,
            "timings_table": p.stderr[p.stderr.find("start-up and render"):][:8000]}  # from its title, bounded


def _fp32(models: MuseTalk) -> MuseTalk:
    """A float32 copy of the networks for the reference path (same weights)."""
    import copy

    m = copy.copy(models)
    for name in ("unet", "vae", "whisper"):
        setattr(m, name, copy.deepcopy(getattr(models, name)).float())
    m.dtype = torch.float32
    return m


def face_boxes_per_frame(scenario: scenarios.Scenario) -> list[list[int]]:
    """The face box shown in every output frame (single-camera scenes, as the scenarios are)."""
    program = scenario.program
    avatars = [load_avatar(resolve_avatar(s.shots[0].avatar, program.avatars_dir), with_frames=False)
               for s in program.scenes]
    fps = Fraction(program.fps or avatars[0].fps)
    lengths = [load_speech(s.audio, torch.device("cpu"))[1].size for s in program.scenes]
    starts = np.cumsum([0, *lengths])
    bounds = [round(Fraction(int(n), AUDIO_RATE) * fps) for n in starts[:-1]]
    bounds.append(math.ceil(Fraction(int(starts[-1]), AUDIO_RATE) * fps))
    boxes = []
    for k, (scene, avatar) in enumerate(zip(program.scenes, avatars)):
        for local in range(bounds[k + 1] - bounds[k]):
            step = scene.start_frame + math.floor(Fraction(local) / fps * avatar.fps)
            boxes.append(avatar.boxes[ping_pong(step, avatar.num_frames)].tolist())
    return boxes


def face_psnr(output: Path, reference: Path, scenario: scenarios.Scenario) -> float:
    """Mean PSNR (dB) of the luma inside the face boxes, output vs the lossless reference render."""
    boxes = face_boxes_per_frame(scenario)
    values = []
    with av.open(str(output)) as a, av.open(str(reference)) as b:
        a.streams.video[0].thread_type = b.streams.video[0].thread_type = "AUTO"  # frame threads: 1080p decodes
        for box, x, y in zip(boxes, a.decode(video=0), b.decode(video=0)):
            x1, y1, x2, y2 = box
            d = x.to_ndarray()[y1:y2, x1:x2].astype(np.float64) - y.to_ndarray()[y1:y2, x1:x2]
            values.append(10 * math.log10(255 ** 2 / max(float(np.mean(d ** 2)), 1e-10)))
    return float(np.mean(values)) if values else float("nan")


def ablations(inductor: str) -> dict[str, Variant]:
    """Each optimisation of the fast path, and the wiring that turns it off."""

    def fast(m: MuseTalk, buckets: tuple[int, ...] | None = None, **change) -> ModuleEngine:
        """The fast engine with one option changed."""
        return ModuleEngine(m, EngineOptions(batch=FAST_BATCH, inductor=inductor, **change), buckets=buckets)

    one_bucket = (FAST_BATCH,)
    rows = {
        "cuda graphs": Variant("no graphs", lambda m: fast(m, one_bucket, graphs=False)),
        "gpu blending": Variant("cpu blend", lambda m: CPUBlendEngine(
            m, EngineOptions(batch=FAST_BATCH, inductor=inductor), buckets=one_bucket)),
        "gathered windows": Variant(windows=audio_windows_loop),
        "in-process encode": Variant(writer=legacy.PNGSequenceWriter),
        "yuv path": Variant("rgb", lambda m: RGBEngine(m, EngineOptions(batch=FAST_BATCH, inductor=inductor)),
                            writer=RGBToI420Writer),
        "parallel encode": Variant(options={"encoders": 1}),
        "upsample fusion": Variant("plain upsample", lambda m: fast(m, upsample="plain")),
        "mask-rows decode": Variant("full decode", lambda m: fast(m, decode_rows="full")),
    }
    if inductor != "off":
        rows["compile"] = Variant("no compile", lambda m: ModuleEngine(m, EngineOptions(batch=FAST_BATCH)))
    return rows


def _commit() -> str:
    """The code's commit: LIPSTREAM_COMMIT (a copied tree may carry a stale .git), else git, else unknown."""
    if os.environ.get("LIPSTREAM_COMMIT"):
        return os.environ["LIPSTREAM_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


HEADER = ("scenario", "mode", "frames", "fps", "wall s", "speed-up", "first frame s", "disk written MB", "peak GPU GiB",
          "PSNR dB")


def cells(row: dict) -> list[str]:
    speedup = f"{row['speedup']:.1f}x" if row.get("speedup") else "-"
    return [row["scenario"], row["mode"], str(row["frames"]), f"{row['fps']:.1f}", f"{row['wall_s']:.2f}", speedup,
            f"{row['first_frame_s']:.2f}", f"{row['disk_bytes_written'] / 1e6:.1f}", f"{row['peak_gpu_gib']:.2f}",
            f"{row['psnr_db']:.1f}"]


def markdown(report: dict) -> str:
    lines: list[str] = [f"# LipStream bench ({report['date']}, {report['device']}, {report['size']})", "",
             f"Weights: {report['weights']}. Commit {report.get('commit', 'unknown')}. Scenarios scaled by "
             f"{report['scale']}. Fast rows: compile `{report['compile']}`, batch {report['batch']}, x264 "
             f"`{report['preset']}`, {report['cpus']} CPUs, each after a warm start. `fast -X` is the fast path "
             "with optimisation X turned off. PSNR: luma of the face boxes against the eager fp32 reference "
             "path rendered losslessly (the outputs themselves are crf 18).", ""]
    if report.get("command"):
        lines += [f"Command: `{report['command']}`", ""]
    lines += ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cells(r)) + " |" for r in report["rows"]]
    shots = [r for r in report["rows"] if r["mode"].startswith("one-shot")]
    if shots:
        lines += ["", "One-shot rows: a fresh `lipstream broadcast` process with default flags, timed from its "
                  "start to the finished MP4 (wall s), first frame = first encoded packet from the process start:",
                  ""] + [f"- {r['scenario']} {r['mode']}: {r.get('engine')}" for r in shots]
    lines += ["", "Startup of each fast configuration (build, compile, graph capture, a one-second warm-up "
              "render), once per engine, per bench call:", "", "| call | engine | startup s |", "|---|---|---|"]
    for call, engines in report["startup"].items():
        if isinstance(engines, dict):
            lines += [f"| {call} | {k} | {v:.1f} |" for k, v in engines.items()]
    lines += ["", f"![fps]({report['chart']})" if report.get("chart") else f"({figures.NO_CHART})", ""]
    lines += [f"![freeze frame, legacy vs fast, with a close-up of the blend seam]({p})" for p in report["freeze_frames"]]
    return "\n".join(lines) + "\n"
