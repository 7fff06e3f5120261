"""A server that started on the uncompiled steps moves onto the compiled packages once they are built.

With nothing cached, compiling the frame steps takes minutes (Inductor at start: 105 s of a 124 s cold
start on the H200). A server instead starts on the modules' steps (CUDA graphs, seconds), answers ready,
and runs `lipstream warmup` in a process of its own at low priority (the live encoders keep the CPUs
they need). When the packages are built, the live engine takes them between two steps
(LiveEngine.use_compiled) and admits by their measured cost from then on. Later starts load the packages
at once. A build that fails leaves the server as it is, on the uncompiled steps, and says why.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lipstream.live import LiveEngine
    from lipstream.engine.networks import PendingPackages

log = logging.getLogger("lipstream.serve")

NICE = 10  # the build's priority under the server's own processes


class StepsUpgrade:
    """The background build and the move onto its packages. `state`: building, compiled, failed, stopped."""

    def __init__(self, live: LiveEngine, pending: PendingPackages, *, log_path: str | None = None):
        self.live, self.pending = live, pending
        self.state = "building"
        self.message = ""
        self._proc: subprocess.Popen | None = None
        self._stop = threading.Event()
        self._log_path = log_path
        self._thread = threading.Thread(target=self._run, name="lipstream-upgrade", daemon=True)

    def start(self) -> StepsUpgrade:
        self._thread.start()
        return self

    def stop(self) -> None:
        """The server stops: the build stops with it (a half-built package is never kept: warmup writes
        each one atomically)."""
        self._stop.set()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._thread.join(15)
        if self.state == "building":
            self.state = "stopped"

    def _run(self) -> None:
        from lipstream.engine import aot
        from lipstream.engine.networks import LIVE_KINDS

        t0 = time.perf_counter()
        device = self.pending.device
        cmd = [sys.executable, "-m", "lipstream", "warmup", *self.pending.network_args, "--device", str(device)]
        log.info(json.dumps({"event": "compiling", "message": "building the compiled engine beside the server",
                             "command": " ".join(cmd[2:])}))
        try:
            with open(self._log_path or os.devnull, "ab") as sink:
                self._proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT,
                                              preexec_fn=(lambda: os.nice(NICE)) if os.name == "posix" else None)
                code = self._proc.wait()
            if self._stop.is_set():
                return
            build_s = time.perf_counter() - t0
            if code != 0:
                raise RuntimeError(f"`lipstream warmup` exited {code}")
            compiled = aot.load_compiled(self.pending.config, self.pending.source, device, kinds=LIVE_KINDS)
            step_s = self.live.use_compiled(compiled)
        except Exception as e:  # noqa: BLE001  (the server goes on as it is)
            self.state, self.message = "failed", f"{type(e).__name__}: {e}"[:300]
            log.warning(json.dumps({"event": "compile_failed", "message": self.message,
                                    "engine": "modules, uncompiled (as started)"}))
            return
        self.state = "compiled"
        log.info(json.dumps({"event": "engine_upgraded", "engine": "compiled packages",
                             "build_s": round(build_s, 1), "seconds": round(time.perf_counter() - t0, 1),
                             "steps_s": {str(b): round(s, 4) for b, s in step_s.items()},
                             "capacity_fps": round(self.live.capacity_fps or 0, 1)}))
