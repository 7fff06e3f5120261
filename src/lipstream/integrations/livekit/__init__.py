"""LipStream as a LiveKit Agents avatar (`pip install lipstream[livekit]`).

- `LipStreamVideoGenerator`: a live session as LiveKit's `VideoGenerator`, for `AvatarRunner`.
- `AvatarSession`: the agent's side of a `lipstream livekit-worker` (the avatar in another process,
  usually on a GPU machine): `await AvatarSession(worker_url=..., avatar="anna").start(session, room)`.
- `start_in_process`: the avatar in the agent's own process, over a LiveEngine it holds.
- `AvatarWorker`: what `lipstream livekit-worker` runs (one engine, many rooms).

Importing this imports livekit-agents; nothing else in lipstream does. It also starts LiveKit's
native FFI server on a thread of its own: at start-up the FFI probes for NVENC by making a CUDA
context current on the calling thread and leaves it there (livekit/rust-sdks#712), after which
PyTorch's CUDA calls on that thread fail ("invalid device context"). Started on a throwaway
thread, it leaves the process's own threads on PyTorch's context; at exit, PyTorch's context is
made current again on the main thread (the FFI probes again when sources are made), before
PyTorch's destructors run there (livekit/cuda.py).
"""

import atexit
import threading

from lipstream.errors import require

require("livekit", "lipstream.integrations.livekit")

from lipstream.integrations.livekit.cuda import restore_torch_cuda_context  # noqa: E402

atexit.register(restore_torch_cuda_context)  # before the FFI's own handler: runs after it (atexit is LIFO)


def _start_livekit_ffi() -> None:
    from livekit.rtc._ffi_client import FfiClient

    if FfiClient._instance is None:
        starter = threading.Thread(target=lambda: FfiClient.instance, name="livekit-ffi-start", daemon=True)
        starter.start()
        starter.join()


_start_livekit_ffi()

from lipstream.integrations.livekit.agent import (  # noqa: E402
    AvatarError, AvatarSession, LocalAvatar, dispatch_token, route_audio_to_worker, start_in_process)
from lipstream.integrations.livekit.generator import LipStreamVideoGenerator  # noqa: E402
from lipstream.integrations.livekit.worker import AvatarWorker, DispatchError  # noqa: E402

__all__ = ["restore_torch_cuda_context", "AvatarError", "AvatarSession", "AvatarWorker", "DispatchError", "LipStreamVideoGenerator", "LocalAvatar",
           "dispatch_token", "route_audio_to_worker", "start_in_process"]
