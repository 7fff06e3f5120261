"""`lipstream serve`: start the service (every cache warm), then uvicorn until SIGTERM or Ctrl-C."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from lipstream.models import MuseTalk
from lipstream.serve.options import ServeOptions, is_loopback
from lipstream.serve.speech_socket import MAX_PCM_BYTES

# what uvicorn reads of one WebSocket message at most (its default: 16 MiB), closing with 1009 past it;
# the speech socket refuses a message over MAX_PCM_BYTES itself, with an error message that says why
WS_MAX_BYTES = 2 * MAX_PCM_BYTES


def serve(options: ServeOptions, models: MuseTalk, *, inductor: str = "off", compiled=None, pending=None,
          engine: str | None = None) -> None:
    """`inductor`: torch.compile of the live steps ("off", "vae", "all": engine options); `compiled`: the
    steps as ahead-of-time packages instead (engine/aot.py's CompiledNetworks); `pending`: packages to build
    beside the running server and move onto (startup.PendingPackages); `engine`: how that reads in the log."""
    import uvicorn

    from lipstream.serve.app import create_app
    from lipstream.serve.service import Service

    log = logging.getLogger("lipstream.serve")
    t = time.perf_counter()
    service = Service(options, models, inductor=inductor, compiled=compiled, pending=pending).start()
    if engine is None:
        engine = "compiled packages" if compiled is not None else f"modules, inductor {inductor}"
    log.info(json.dumps({"event": "ready", "seconds": round(time.perf_counter() - t, 1), "engine": engine,
                         "phases": service.start_phases,
                         "avatars": sorted(service.avatars), "host": options.host, "port": options.port,
                         "keys": len(options.api_keys)}))
    if not options.api_keys:
        log.warning(json.dumps({"event": "no_api_keys", "message": f"no API keys: anyone on {options.host} "
                                "can use this server (allowed on a loopback address only)"}))
    assert options.api_keys or is_loopback(options.host)
    config = uvicorn.Config(create_app(service), host=options.host, port=options.port, log_config=None,
                            timeout_graceful_shutdown=30, ws_max_size=WS_MAX_BYTES)
    # uvicorn shuts down on SIGTERM, then raises the signal again under the handler it found: a
    # no-op one here, so a graceful stop ends with status 0 (not killed by the signal)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn.Server(config).run()
    log.info(json.dumps({"event": "stopped"}))


@contextmanager
def in_thread(service, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """The app of a started Service served by uvicorn on a thread of this process (tests, notebooks):
    yields its base URL (port 0: a free one); stops it on exit."""
    import uvicorn

    from lipstream.serve.app import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(service), host=host, port=port, log_config=None,
                                           ws_max_size=WS_MAX_BYTES))
    thread = threading.Thread(target=server.run, daemon=True, name="lipstream-uvicorn")
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError(f"uvicorn did not start on {host}:{port}")
        time.sleep(0.05)
    try:
        yield f"http://{host}:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
