"""The GPU's context made while torch imports: the CUDA driver's primary context, retained on a thread.

A one-shot command spends seconds importing torch, and only then does its first CUDA call create the
device's context (driver initialisation, the context, its memory reservations): another fraction of a
second, one after the other. The driver API needs no torch: called through ctypes on a thread before
`import torch`, the same primary context (the one the CUDA runtime, and so torch, uses for that device) is
made while the import runs, and torch's first call finds it ready. Retained for the process's life: the
driver frees it at exit.

Only on a machine with one visible GPU (the runtime and the driver may number several differently, and a
context on the wrong card would cost its memory), and never where torch is already imported. Anything that
fails here is silent: torch then makes the context itself, as it always did.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading


class EarlyContext:
    """The thread making the context: `wait(timeout)` says whether it was made."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.made = False
        self.error = ""
        self._thread = threading.Thread(target=self._run, name="lipstream-cuda-context", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")  # what torch sets before its own cuInit
            cuda = ctypes.CDLL("libcuda.so.1")
            if cuda.cuInit(0) != 0:
                self.error = "cuInit failed"
                return
            count = ctypes.c_int()
            if cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value != 1:
                self.error = f"{count.value} devices"
                return
            device, ctx = ctypes.c_int(), ctypes.c_void_p()
            if cuda.cuDeviceGet(ctypes.byref(device), 0) != 0:
                self.error = "cuDeviceGet failed"
                return
            if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device) != 0:
                self.error = "cuDevicePrimaryCtxRetain failed"
                return
            self.made = True
        except (OSError, AttributeError) as e:  # no driver here (a CPU machine)
            self.error = str(e)
        finally:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        self._done.wait(timeout)
        return self.made


def start_primary_context(device: str = "auto") -> EarlyContext | None:
    """Begin making the GPU's context on a thread, if this command will use the one GPU; else None."""
    if "torch" in sys.modules:  # too late: torch may be making its own
        return None
    if device not in ("auto", "cuda", "cuda:0"):
        return None
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return None
    return EarlyContext()
