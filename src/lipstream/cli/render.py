"""`lipstream compile | render | broadcast | warmup | features`: avatars in, MP4s out."""

from __future__ import annotations

import gc
import importlib
import os
import threading
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from lipstream.cli.common import (
    AvatarsOpt, BatchOpt, CompileOpt, CrfOpt, DecodeRowsOpt, DeviceOpt, EncoderProcessesOpt, EncodersOpt, FpsOpt,
    KeySyncPresetOpt, ModelOpt, ModelsOpt,
    OldPresetOpt, RandomOpt, RandomSizeOpt, ReferenceOpt, ServerKeyOpt, ServerOpt, TimingsOpt, X264PresetOpt, app,
    avatars_dir, click, compile_choice, err, load_models, mark_finished, out, process_age, renamed, report_line,
    start_without_collections, warn_random_weights)
from lipstream.errors import InputError, LipStreamError, require
from lipstream.files import check_file
from lipstream.render.options import RenderOptions
from lipstream.cli.checks import check_models, fps_option, in_range, machine_options, model_options, render_options
from lipstream.files import check_output_path
from lipstream.render.checks import check_program
from lipstream.cli.keysync import prepare_keysync, render_keysync_cli
from lipstream.models.config import random_size_for
from lipstream.show.checks import check_show, declared_durations, frame_size_of


@app.command("compile")
def compile_cmd(inputs: Annotated[list[Path], typer.Argument(help="Videos or images (stills), or folders of them.")],
                output: Annotated[Path, typer.Option("-o", "--output", help="Avatars folder (one sub-folder per avatar).")],
                force: Annotated[bool, typer.Option(help="Compile again even if the input is unchanged.")] = False,
                track: Annotated[Optional[Path], typer.Option(
                    help="Precomputed landmarks or boxes (JSON) for one input, or a folder of <name>.track.json.")] = None,
                save_track: Annotated[Optional[Path], typer.Option(
                    help="Write the tracked landmarks to DIR/<name>.track.json.")] = None,
                extra_margin: Annotated[int, typer.Option(help="Pixels added below the chin (MuseTalk v1.5: 10).")] = 10,
                bbox_shift: Annotated[int, typer.Option(help="Move the box's centre line down (+) or up (-), px.")] = 0,
                fps: Annotated[Optional[str], typer.Option(help="Override the loop's frame rate (stills: 25).")] = None,
                tracker: Annotated[str, typer.Option(
                    help="Face tracker: auto (DWPose where its weights are, else dlib where installed), dwpose "
                         "(Apache-2.0 weights, on the GPU) or dlib (CPU; non-commercial model).")] = "auto",
                models: ModelsOpt = None, random_weights: RandomOpt = False, random_size: RandomSizeOpt = "auto",
                device: DeviceOpt = "auto", timings: TimingsOpt = False,
                keysync: Annotated[bool, typer.Option(
                    "--keysync", help="Also prepare what `render --model keysync` reads: the face square's SVD "
                                      "latents and masks at 512x512 (needs KeySync's SVD VAE).")] = False) -> None:
    """Compile action loops into avatars: face track, boxes, blend masks, VAE latents, source frames."""
    machine_options(device, random_size)
    fps_option(fps)
    in_range("--extra-margin", extra_margin, 0, 200, "pixels")
    in_range("--bbox-shift", bbox_shift, -200, 200, "pixels")
    for path in inputs:
        if not path.exists():
            raise InputError(path, "no such video, image or folder")
    if output.exists() and not output.is_dir():
        raise InputError(output, "is a file, expected the avatars folder")
    if track is not None and not track.exists():
        raise InputError(track, "no such track file or folder")
    check_models(models, random_weights)
    if keysync and not random_weights:
        from lipstream.models.download import MODEL_FILES, missing_files
        from lipstream.models.layout import HOW_TO_GET, models_dir

        missing = [f for f in missing_files(models_dir(models), MODEL_FILES["keysync"]) if "/vae/" in f.path]
        if missing:
            raise LipStreamError(f"--keysync: the SVD VAE is not in {models_dir(models)} (missing {missing[0].path}); "
                                 f"{HOW_TO_GET.replace('download', 'download --model keysync')}")
    from lipstream.avatar.video import expand_inputs
    from lipstream.avatar.trackers import DLIB_LICENCE, choose_tracker, make_tracker
    from lipstream.models.layout import models_dir

    kind = choose_tracker(tracker, models_dir(models), random_weights) if track is None else None
    sources = expand_inputs(list(inputs))
    with start_without_collections():  # as render's start: the GPU's context and the first loop's decode
        from lipstream.engine.cuda_context import start_primary_context  # begin while torch imports

        start_primary_context(device)
        from lipstream.avatar.video import LoopsAhead

        loops = LoopsAhead(sources, fps_option(fps))
        t_checked = process_age()
        try:
            from lipstream.avatar.compile import quietly
            from lipstream.engine.networks import pick_device, warm_gpu_libraries

            dev = pick_device(device)
            warming = warm_gpu_libraries(dev)
            t_torch = process_age()
            face, tracker_warming = None, None
            if kind is not None:  # DWPose's first batch run on a thread while the VAE loads
                face = make_tracker(kind, models_dir(models), random_weights, random_size_for(random_size, dev.type),
                                    dev)
                if dev.type == "cuda" and hasattr(face, "warm"):
                    tracker_warming = threading.Thread(target=quietly, args=(face.warm,), daemon=True,
                                                       name="lipstream-warm-tracker")
                    tracker_warming.start()
            m = load_models(models, device, random_weights, random_size, components=["vae"])
            if tracker_warming is not None:
                tracker_warming.join()
            if face is not None:
                if kind == "dlib":
                    out.print(f"[yellow]face tracker: dlib's 68-point model ({DLIB_LICENCE})[/]")
                elif random_weights:
                    out.print("[yellow]face tracker: DWPose with random weights: it finds no face, every frame is "
                              "taken as one and the boxes fall anywhere; pass --track FILE, or get the real weights[/]")
                else:
                    out.print("face tracker: DWPose (dw-ll_ucoco_384, Apache-2.0)")
            if warming is not None:
                warming.join()
            t_networks = process_age()
        except BaseException:
            loops.close()
            raise
    from rich.table import Table

    from lipstream.avatar import CompileOptions, compile_many

    try:
        results = compile_many(sources, output, m.vae, m.fingerprints["vae"], track=track, save_track_dir=save_track,
                               tracker=face, options=CompileOptions(extra_margin, bbox_shift, fps=fps), force=force,
                               vae_random=m.config.name if m.random_weights else None, loops=loops)
    finally:
        loops.close()
        gc.unfreeze()
    table = Table(title=f"avatars in {output}")
    for col in ("avatar", "status", "frames", "size", "fps", "face box", "time", "note"):
        table.add_column(col)
    colours = {"compiled": "green", "skipped": "cyan", "failed": "red"}
    for r in results:
        table.add_row(r.name, f"[{colours[r.status]}]{r.status}[/]", str(r.frames or ""),
                      f"{r.size[0]}x{r.size[1]}" if r.frames else "", r.fps,
                      f"{r.face[0]}x{r.face[1]}" if r.frames else "", f"{r.seconds:.1f} s" if r.seconds else "",
                      r.message)
    out.print(table)
    failed = [r for r in results if r.status == "failed"]
    if keysync:
        prepare_keysync([output / r.name for r in results if r.status != "failed"], models, random_weights,
                         random_size, dev)
    if failed:
        raise LipStreamError(f"{len(failed)} of {len(results)} inputs failed: " + "; ".join(r.message for r in failed))
    if timings:
        _print_compile_timings(results, {"imports and checks": t_checked, "torch and the device": t_torch - t_checked,
                                         "networks and tracker": t_networks - t_torch})
    mark_finished()


def _print_compile_timings(results, before: dict[str, float]) -> None:
    """--timings: where compile's time went, from the process start; each avatar's steps after."""
    from rich.table import Table

    table = Table(title=f"compile, seconds ({process_age():.2f} s since the process started)")
    for col in ("step", "seconds"):
        table.add_column(col)
    for name, seconds in before.items():
        table.add_row(name, f"{seconds:.2f}")
    names = {"decode": "decode: wait past the start", "track": "landmarks (tracker or track file)",
             "masks_crops": "masks and crops", "latents": "VAE latents", "write_wait": "frames file: wait past the latents"}
    for r in results:
        for key, seconds in r.timings.items():
            table.add_row(f"{r.name}: {names.get(key, key)}", f"{seconds:.2f}")
        if r.seconds:
            table.add_row(f"{r.name}: in all", f"{r.seconds:.2f}")
    out.print(table)


def _import_quietly(module: str) -> None:
    """Import `module` ahead, on a thread; a failure is left for the caller's own import to raise, in one line."""
    try:
        importlib.import_module(module)
    except BaseException:  # noqa: BLE001
        pass


def _render(program, output: Path, options: RenderOptions, device: str, random_size: str, compile: str, models,
            random_weights: bool, timings: bool = False, model: str = "musetalk",
            keysync_preset: str = "reference") -> None:
    """Check everything a user typed (no torch yet: a mistake costs a fraction of a second), then render."""
    machine_options(device, random_size)
    metas = check_program(program, options.avatars_dir, output)
    check_show(program, frame_size_of(metas.values()), declared_durations(program) if program.show.visual() else None)
    if any(scene.text is not None for scene in program.scenes):  # the voice checked (and named) before networks
        from lipstream.show.tts import pick_voice

        err.print(f"text scenes spoken by {pick_voice(program.show.voice).name}", highlight=False)
    from lipstream.render.script import scene_models

    kinds = scene_models(program, model)
    if "keysync" in kinds:
        render_keysync_cli(program, output, options, device, random_size, models, random_weights, keysync_preset, kinds,
                        compile, model)
        return
    check_models(models, random_weights)
    with start_without_collections():  # the start makes what lives as long as the process
        from lipstream.engine.cuda_context import start_primary_context

        start_primary_context(device)  # the GPU's context made while torch imports
        t_checked = process_age()

        import torch

        from lipstream.engine.networks import load_networks, pick_device, warm_gpu_libraries

        dev = pick_device(device)
        warming = warm_gpu_libraries(dev)
        t_torch = process_age()
        options = options.for_machine(dev.type, os.cpu_count() or 1)
        if options.encoder_processes and options.encoders > 1:  # the workers import PyAV while the networks load,
            from lipstream.media.mp4 import arena_slots  # and the frames' shared memory is faulted in meanwhile
            from lipstream.media.segment_pool import segment_pool

            segment_pool(options.encoders).prepare(*frame_size_of(metas.values()), arena_slots(options.encoders))
        reference = options.engine.reference
        size = random_size_for(random_size, dev.type, next(iter(metas.values())))
        if random_weights:
            warn_random_weights()
        # the renderer's modules (PyAV, OpenCV, the show's) imported on a thread while the weights are read on
        # others (file reads and copies, outside the GIL): ~0.2 s of imports off the way to the first frame
        importing = threading.Thread(target=_import_quietly, args=("lipstream.render.program",), name="lipstream-import-render",
                                     daemon=True)
        importing.start()
        nets = load_networks(models, dev, random_weights, size, compile="off" if reference else compile,
                             decode_rows=options.engine.decode_rows, dtype=torch.float32 if reference else None,
                             report=lambda line: err.print(line, highlight=False))
        importing.join()
        from lipstream.render.program import render_program

        if warming is not None:  # done long since, normally: the render captures graphs next
            warming.join()

    t_networks = process_age()
    where = f"{size} random networks" if random_weights else "networks"
    engine = "reference path" if reference else f"{nets.engine} engine"
    encoders = options.encoders
    err.print(f"{engine}: {where} on {dev}, batch {options.engine.batch}, {encoders} x264 encoder"
              f"{'s' * (encoders > 1)} ({options.x264_preset}, crf {options.crf}"
              f"{', in processes' if options.encoder_processes and encoders > 1 else ''})", highlight=False)
    if nets.note:
        err.print(nets.note, highlight=False, soft_wrap=True)
    try:
        report = render_program(program, output, nets.models, options)
    finally:
        gc.unfreeze()  # what the start froze, collectable again (main() may run again in this process)
    out.print(report_line(report, "reference path" if reference else ""))
    age = process_age()  # what the user waited: imports, networks and set-up included
    started = age - report.wall_s
    out.print(f"process: {age:.2f} s so far, first encoded packet {started + report.first_frame_s:.2f} s "
              "after it started", highlight=False)
    if timings:
        _print_timings(report, nets, {"imports and checks": t_checked, "torch and the device": t_torch - t_checked,
                                      "networks": t_networks - t_torch, "render set-up": max(0.0, started - t_networks)})
    if random_weights:
        out.print("[bold red]random weights: the mouth is noise, not speech[/]")
    mark_finished()


def _print_timings(report, nets, before: dict[str, float]) -> None:
    """--timings: where the process's time went, from its start to the finished MP4."""
    from rich.table import Table

    t = report.timings
    table = Table(title="start-up and render, seconds from the process start")
    for col in ("step", "seconds", "note"):
        table.add_column(col)
    notes = {"networks": f"{nets.engine} engine" + "".join(
        f", {k.removesuffix('_s')} {v:.2f} s" for k, v in nets.timings.items() if k != "networks_s")}
    for name, seconds in before.items():
        table.add_row(name, f"{seconds:.2f}", notes.get(name, ""))
    def captured(later: bool) -> str:  # each bucket's step and blend: "step 8 0.61, blend 8 0.05"
        prefix = "warmup later " if later else "warmup "
        return ", ".join(f"{k.removeprefix(prefix).removesuffix(' s')} {v:.2f}" for k, v in t.items()
                         if k.startswith(prefix) and k.endswith(" s") and k.startswith("warmup later ") == later)

    # who waited for whom in the render loop: the GPU side (producer) or the encoders (writer)
    stages = (f"waits: for a free buffer {t.get('produce_buffer_wait_s', 0):.2f}, for frames "
              f"{t.get('consume_wait_s', 0):.2f}, for the GPU {t.get('consume_gpu_wait_s', 0):.2f}; "
              f"to the encoders {t.get('consume_write_s', 0):.2f}") if "consume_write_s" in t else ""
    if t.get("loop_s"):  # the cores the process kept busy (the encoders' threads too): headroom or not
        stages += f"; {t['loop_cpu_s'] / t['loop_s']:.1f} of {os.cpu_count()} cores busy"
    if "produce_show_s" in t:  # the show's layers, in the producer's time (its video decoders' waits within)
        stages += (f"; the show's layers {t['produce_show_s']:.2f}, waiting on its video decoders "
                   f"{t.get('show_decoder_wait_s', 0):.2f}")
    rows = [("avatars: load", t.get("load_s"), ""),
            ("graph capture", t.get("warmup_s"), "; ".join(["the audio decodes meanwhile", captured(False)]).strip("; ")),
            ("audio decode: wait past the capture", t.get("decode_wait_s"), ""),
            ("show layers and music: wait past the capture", t.get("show_wait_s"), "made beside the capture"),
            ("audio: Whisper features and windows", t.get("audio_s"), ""),
            ("first encoded packet (after render start)", report.first_frame_s, ""),
            ("graph capture, the other buckets", t.get("warmup_later_s"),
             "; ".join(["in the render loop, as the first frames encode", captured(True)]).strip("; ")),
            ("graph capture, the other buckets", 0.0 if "warmup_later_skipped_frames" in t else None,
             f"none: the first bucket ({t.get('first_bucket_fps', 0):.0f} frames/s) rendered the "
             f"{t.get('warmup_later_skipped_frames', 0):.0f} frames left sooner than a capture would repay"),
            ("frames (render loop)", report.wall_s - t.get("finish_s", 0.0) - sum(
                t.get(k, 0.0) for k in ("audio_s", "load_s", "warmup_s", "decode_wait_s", "plan_s", "show_wait_s")), stages),
            ("flush: last segments, audio, faststart", t.get("finish_s"), "")]
    for name, seconds, note in rows:
        if seconds is not None:
            table.add_row(name, f"{seconds:.2f}", note)
    table.add_row("render_program total", f"{report.wall_s:.2f}", f"{report.frames} frames")
    err.print(table)


@app.command("render")
def render_cmd(ctx: typer.Context,
               avatar: Annotated[str, typer.Option(help="Compiled avatar: a name in --avatars, or its folder.")],
               audio: Annotated[Path, typer.Option(help="Speech: any audio file, or a video with audio.")],
               output: Annotated[Path, typer.Option("-o", "--output", help="Output .mp4 (H.264 + AAC).")],
               avatars: AvatarsOpt = None,
               start_frame: Annotated[int, typer.Option(help="Where in its loop the avatar starts.")] = 0,
               fps: FpsOpt = None, crf: CrfOpt = 18, x264_preset: X264PresetOpt = None, preset: OldPresetOpt = None,
               reference: ReferenceOpt = False, batch: BatchOpt = None, encoders: EncodersOpt = None,
               encoder_processes: EncoderProcessesOpt = None, compile: CompileOpt = None, decode_rows: DecodeRowsOpt = "auto", models: ModelsOpt = None,
               random_weights: RandomOpt = False, random_size: RandomSizeOpt = "auto", device: DeviceOpt = "auto",
               timings: TimingsOpt = False, server: ServerOpt = None, api_key: ServerKeyOpt = None,
               model: ModelOpt = "musetalk", keysync_preset: KeySyncPresetOpt = "reference") -> None:
    """Make an avatar speak an audio file: one lip-synced MP4 (here, or on a server with --server)."""
    from lipstream.render.script import single_scene

    in_range("--start-frame", start_frame, 0, 10**9, "a loop frame")
    model_options(model, keysync_preset, server=server, reference=reference, batch=batch, compile=compile,
                  decode_rows=decode_rows)
    options = render_options(fps, crf, renamed("--preset", "--x264-preset", preset, x264_preset), batch, encoders,
                             decode_rows, reference, encoder_processes)
    program = single_scene(avatar, audio, start_frame)
    if server:
        _on_server(ctx, program, "render", output, options, start_frame, server, api_key, avatars=avatars,
                   reference=reference, batch=batch, encoders=encoders,
                   encoder_processes=encoder_processes, compile=compile, decode_rows=decode_rows,
                   models=models, random_weights=random_weights, random_size=random_size, device=device,
                   timings=timings, model=model)
        return
    _render(program, output, options.replace(avatars_dir=avatars_dir(avatars)), device, random_size,
            compile_choice(compile), models, random_weights, timings, model, keysync_preset)


@app.command("broadcast")
def broadcast_cmd(ctx: typer.Context,
                  script: Annotated[Path, typer.Argument(help="YAML: scenes of avatar + audio, cuts, crossfades.")],
                  output: Annotated[Path, typer.Option("-o", "--output", help="Output .mp4 (H.264 + AAC).")],
                  avatars: AvatarsOpt = None, fps: FpsOpt = None, crf: CrfOpt = 18, x264_preset: X264PresetOpt = None,
                  preset: OldPresetOpt = None, reference: ReferenceOpt = False, batch: BatchOpt = None,
                  encoders: EncodersOpt = None, encoder_processes: EncoderProcessesOpt = None,
                  compile: CompileOpt = None, decode_rows: DecodeRowsOpt = "auto", models: ModelsOpt = None, random_weights: RandomOpt = False, random_size: RandomSizeOpt = "auto",
                  device: DeviceOpt = "auto", timings: TimingsOpt = False, server: ServerOpt = None,
                  api_key: ServerKeyOpt = None, model: ModelOpt = "musetalk",
                  keysync_preset: KeySyncPresetOpt = "reference") -> None:
    """Render a multi-scene script (several presenters, camera cuts) into one continuous MP4 (here, or on a
    server with --server: the script and every audio file it names are uploaded)."""
    from lipstream.render.script import load_script

    model_options(model, keysync_preset, server=server, reference=reference, batch=batch, compile=compile,
                  decode_rows=decode_rows)
    options = render_options(fps, crf, renamed("--preset", "--x264-preset", preset, x264_preset), batch, encoders,
                             decode_rows, reference, encoder_processes)
    if server:
        _on_server(ctx, None, "broadcast", output, options, 0, server, api_key, script=script, avatars=avatars,
                   reference=reference, batch=batch, encoders=encoders,
                   encoder_processes=encoder_processes, compile=compile, decode_rows=decode_rows,
                   models=models, random_weights=random_weights, random_size=random_size, device=device,
                   timings=timings, model=model)
        return
    _render(load_script(script), output, options.replace(avatars_dir=avatars_dir(avatars)), device, random_size,
            compile_choice(compile), models, random_weights, timings, model, keysync_preset)


def _on_server(ctx: typer.Context, program, kind: str, output: Path, options: RenderOptions, start_frame: int,
               server: str, api_key: str | None, *, script: Path | None = None, avatars, reference, batch, encoders,
               encoder_processes, compile, decode_rows, models, random_weights, random_size, device, timings,
               model: str = "musetalk") -> None:
    """--server: the address checked, every flag only a local render takes refused (one line naming it),
    then the job handed over (cli/remote.py). Never a local render instead."""
    require("serve", f"lipstream {kind} --server", "httpx")
    from lipstream.cli.remote import refuse_local_options, render_on_server
    from lipstream.client.jobs import server_url

    url = server_url(server)
    from_env = ctx.get_parameter_source("server") == click.core.ParameterSource.ENVIRONMENT
    refuse_local_options({"--avatars": avatars is not None, "--reference": reference, "--batch": batch is not None,
                          "--encoders": encoders is not None,
                          "--encoder-processes/--encoder-threads": encoder_processes is not None, "--compile/--no-compile": compile is not None,
                          "--decode-rows": decode_rows != "auto", "--models": models is not None,
                          "--random-weights": random_weights, "--random-size": random_size != "auto",
                          "--device": device != "auto", "--timings": timings}, from_env)
    if script is not None:
        from lipstream.render.script import load_script

        program = load_script(script)
    render_on_server(program, kind, output, options, start_frame, url, api_key or None, model)


@app.command("warmup")
def warmup_cmd(models: ModelsOpt = None, random_weights: RandomOpt = False,
               random_size: Annotated[str, typer.Option(
                   "--random-size", help="With --random-weights: full or tiny (auto: tiny on a CPU, full on a GPU).")]
               = "auto",
               decode_rows: DecodeRowsOpt = "auto", device: DeviceOpt = "auto",
               force: Annotated[bool, typer.Option(help="Build again even if cached.")] = False,
               jobs: Annotated[Optional[int], typer.Option(
                   min=1, max=8, show_default=False,
                   help="Packages built at once, each in a process of its own (default: $LIPSTREAM_WARMUP_JOBS, "
                        "else one per 5 cores).")] = None) -> None:
    """Build the compiled engine for this machine ahead of time (in a container build, or at provisioning).

    Writes AOTInductor packages and the weights they read to the cache folder ($LIPSTREAM_CACHE,
    default ~/.cache/lipstream/aot); renders then load them in about a second. Safe to delete.
    """
    machine_options(device, random_size)
    render_options(None, 18, None, None, None, decode_rows)
    check_models(models, random_weights)

    from lipstream.engine.networks import KINDS_FOR_ROWS, pick_device, warmup

    dev = pick_device(device)
    size = random_size_for(random_size, dev.type)
    if random_weights:
        warn_random_weights()
    t0 = time.perf_counter()
    built = warmup(models, dev, random_weights, size, kinds=KINDS_FOR_ROWS[decode_rows], force=force,
                   report=lambda line: err.print(line, highlight=False, soft_wrap=True), parallel=jobs)
    failed = [b for b in built if b.status == "failed"]
    out.print(f"compiled engine for {dev}: {sum(b.status == 'built' for b in built)} built, "
              f"{sum(b.status == 'cached' for b in built)} already cached, {len(failed)} failed, "
              f"{time.perf_counter() - t0:.1f} s", highlight=False)
    if failed:
        raise LipStreamError("could not compile: " + "; ".join(f"{b.kind}: {b.message}" for b in failed)
                             + " (renders use the uncompiled engine for these)")


@app.command("features")
def features(audio: Annotated[Path, typer.Argument(help="Audio file, or a video with an audio track.")],
             fps: Annotated[str, typer.Option(help="Video frame rate the windows align to (25, 29.97, 30000/1001).")] = "25",
             output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Save features + windows (.safetensors).")] = None,
             models: ModelsOpt = None, random_weights: RandomOpt = False, random_size: RandomSizeOpt = "auto",
             device: DeviceOpt = "auto") -> None:
    """Decode speech, compute Whisper features and per-frame audio windows; print shapes and timings."""
    rate = fps_option(fps)
    machine_options(device, random_size)
    check_file(audio, "audio file")
    if output is not None:
        check_output_path(output)
    check_models(models, random_weights)

    from lipstream.audio import prepare_speech

    m = load_models(models, device, random_weights, random_size, components=["whisper"])
    speech = prepare_speech(audio, rate, m)
    out.print(f"{audio}: {speech.duration:.3f} s -> {speech.frames} frames at {speech.fps} fps; "
              f"features {tuple(speech.features.shape)}, windows {tuple(speech.windows.shape)} on {m.device}")
    out.print("  " + ", ".join(f"{k} {v:.1f} ms" for k, v in speech.timings_ms.items()))
    if output is not None:
        from lipstream.files import save_safetensors_atomic

        save_safetensors_atomic(output, {"features": speech.features, "windows": speech.windows},
                                {"fps": str(speech.fps), "samples": str(speech.samples.numel()),
                                 "weights": m.source, **{f"fingerprint.{k}": v for k, v in m.fingerprints.items()}})
        out.print(f"wrote {output}")
