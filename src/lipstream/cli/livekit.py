"""`lipstream livekit-worker`: the avatar worker LiveKit agents send into their rooms (integrations.livekit)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from lipstream.cli.common import (
    AvatarsOpt, CompileOpt, DeviceOpt, LivePresetOpt, ModelsOpt, RandomOpt, RandomSizeOpt, app, avatars_dir,
    compile_choice, err, load_models)
from lipstream.errors import UsageError, require
from lipstream.cli.checks import check_models, fps_option, in_range, machine_options
from lipstream.avatar.folders import resolve_avatar


def size_option(value: str | None) -> tuple[int, int] | None:
    """--size WxH: even sides of 16 to 4096 pixels; None stays None."""
    if value is None:
        return None
    try:
        w, h = (int(v) for v in value.lower().split("x"))
    except ValueError:
        raise UsageError(f"--size {value!r}: expected WIDTHxHEIGHT, e.g. 1280x720") from None
    if not (16 <= w <= 4096 and 16 <= h <= 4096) or w % 2 or h % 2:
        raise UsageError(f"--size {value!r}: expected even sides of 16 to 4096 pixels")
    return w, h


@app.command("livekit-worker")
def livekit_worker_cmd(
        url: Annotated[str, typer.Option(envvar="LIVEKIT_URL", show_default=False,
                                         help="The LiveKit server (ws:// or wss://; or $LIVEKIT_URL).")] = "",
        api_key: Annotated[str, typer.Option(envvar="LIVEKIT_API_KEY", show_default=False,
                                             help="The LiveKit project's API key (or $LIVEKIT_API_KEY).")] = "",
        api_secret: Annotated[str, typer.Option(envvar="LIVEKIT_API_SECRET", show_default=False,
                                                help="Its secret (or $LIVEKIT_API_SECRET): the worker mints the "
                                                     "avatar's tokens with it and checks agents' requests.")] = "",
        avatar: Annotated[Optional[list[str]], typer.Option(
            help="A compiled avatar to keep resident (repeatable; the first is the default an agent gets).")] = None,
        avatars: AvatarsOpt = None,
        host: Annotated[str, typer.Option(help="Address the agents' requests come to.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Port the agents' requests come to.")] = 8089,
        fps: Annotated[Optional[str], typer.Option(help="Frame rate of the avatar's video (default: the "
                                                        "avatar's).")] = None,
        size: Annotated[Optional[str], typer.Option(help="Size WxH of the avatar's video (default: the "
                                                         "avatar's).")] = None,
        server: Annotated[Optional[str], typer.Option(
            show_default=False, help="A running `lipstream serve` (http://HOST:PORT) whose engine the rooms use, "
                                     "each a session of it: no engine here, --avatar names its avatars.")] = None,
        server_key: Annotated[Optional[str], typer.Option(
            envvar="LIPSTREAM_API_KEY", show_default=False,
            help="With --server: its bearer key (default: $LIPSTREAM_API_KEY).")] = None,
        live_preset: LivePresetOpt = "realtime", compile: CompileOpt = None,
        models: ModelsOpt = None, random_weights: RandomOpt = False,
        random_size: RandomSizeOpt = "auto", device: DeviceOpt = "auto") -> None:
    """Hold one engine; join the LiveKit room an agent names and speak its replies there, in many rooms at once."""
    require("livekit", "lipstream livekit-worker")
    if not url.startswith(("ws://", "wss://", "http://", "https://")):
        raise UsageError(f"--url {url!r}: expected the LiveKit server, ws://HOST:7880 or wss://... (or $LIVEKIT_URL)")
    if not api_key or not api_secret:
        raise UsageError("--api-key and --api-secret (or $LIVEKIT_API_KEY and $LIVEKIT_API_SECRET) are required")
    if not avatar:
        raise UsageError("--avatar NAME is required (a compiled avatar; repeat it to keep several resident)")
    in_range("--port", port, 0, 65535, "a TCP port")
    rate = fps_option(fps)
    if rate is not None and not 1 <= rate <= 60:
        raise UsageError(f"--fps {fps}: expected 1 to 60 frames per second")
    picture = size_option(size)
    if server is not None:
        from lipstream.client.jobs import server_url

        base = server_url(server)
        for flag, given in (("--models", models), ("--random-weights", random_weights), ("--avatars", avatars),
                            ("--compile/--no-compile", compile is not None)):
            if given:
                raise UsageError(f"{flag}: the engine is the server's with --server; leave it out")
        _check_server_avatars(base, avatar, server_key)
        from lipstream.integrations.livekit.worker import run_worker

        run_worker(None, list(avatar), url=url, api_key=api_key, api_secret=api_secret, options=None, fps=rate,
                   size=picture, host=host, port=port, server=base, server_key=server_key,
                   progress=lambda text: err.print(text, highlight=False))
        return
    root = avatars_dir(avatars)
    folders = [resolve_avatar(name, root) for name in avatar]
    machine_options(device, random_size)
    check_models(models, random_weights)
    from lipstream.live.options import PRESETS

    if live_preset not in PRESETS:
        raise UsageError(f"--live-preset {live_preset!r}: expected one of {', '.join(PRESETS)}")

    from lipstream.integrations.livekit.worker import run_worker

    from lipstream.engine.engines import FAST_INDUCTOR

    m = load_models(models, device, random_weights, random_size)
    choice = compile_choice(compile)
    inductor = FAST_INDUCTOR if choice == "on" or (choice == "auto" and m.device.type == "cuda") else "off"
    run_worker(m, folders, url=url, api_key=api_key, api_secret=api_secret, options=PRESETS[live_preset],
               fps=rate, size=picture, host=host, port=port, inductor=inductor,
               progress=lambda text: err.print(text, highlight=False))


def _check_server_avatars(base: str, names: list[str], key: str | None) -> None:
    """Every --avatar is resident on the server, before any room is served (one line otherwise)."""
    import httpx

    from lipstream.client.jobs import key_refusal

    try:
        r = httpx.get(f"{base}/v1/avatars", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=10)
    except httpx.HTTPError as e:
        raise UsageError(f"--server {base}: cannot be reached ({type(e).__name__})") from None
    if r.status_code in (401, 403):
        raise UsageError(key_refusal(base, r.status_code, bool(key), "--server-key KEY or $LIPSTREAM_API_KEY"))
    if r.status_code != 200:
        raise UsageError(f"--server {base}: GET /v1/avatars answered {r.status_code}")
    resident = [a["name"] for a in r.json()]
    missing = [n for n in names if n not in resident]
    if missing:
        raise UsageError(f"--avatar {missing[0]!r}: not resident on {base} (it has: {', '.join(resident) or 'none'})")
