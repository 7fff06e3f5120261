"""Keeping PyTorch's CUDA context current beside LiveKit's native FFI.

The FFI probes for NVIDIA's encoder and decoder (at start-up, and again when sources and rooms are
made) by creating a CUDA context and leaving it current on the calling thread
(livekit/rust-sdks#712). PyTorch's calls on that thread then fail with "invalid device context";
on the H200 the process aborted at exit, when PyTorch's destructors ran on the main thread. The
engine's own threads never call LiveKit, and a session's calls make no CUDA call; what is left is to
put the device's primary context (PyTorch's) back where LiveKit ran, here through the driver API.
"""

from __future__ import annotations

import ctypes
import logging
import sys

log = logging.getLogger(__name__)


def restore_torch_cuda_context() -> bool:
    """Make the current device's primary context current on this thread; False where there is nothing to do."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        device, context = ctypes.c_int(), ctypes.c_void_p()
        if libcuda.cuDeviceGet(ctypes.byref(device), int(torch.cuda.current_device())) != 0:
            return False
        if libcuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) != 0:
            return False
        done = libcuda.cuCtxSetCurrent(context) == 0
        libcuda.cuDevicePrimaryCtxRelease(device)  # PyTorch holds its own reference
        return done
    except (OSError, RuntimeError) as e:  # no driver library, or PyTorch could not name its device
        log.debug("could not restore PyTorch's CUDA context: %s", e)
        return False
