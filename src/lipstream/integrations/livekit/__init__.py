"""LipStream as a LiveKit Agents avatar (`pip install lipstream[livekit]`).

- `LipStreamVideoGenerator`: a live session as LiveKit's `VideoGenerator`, for `AvatarRunner`.
- `AvatarSession`: the agent's side of a `lipstream livekit-worker` (the avatar in another process,
  usually on a GPU machine): `await AvatarSession(worker_url=..., avatar="anna").start(session, room)`.
- `start_in_process`: the avatar in the agent's own process, over a LiveEngine it holds.
- `AvatarWorker`: what `lipstream livekit-worker` runs (one engine, many rooms).

Importing this imports livekit-agents; nothing else in lipstream does.
"""

from lipstream.integrations.livekit.agent import (
    AvatarError, AvatarSession, LocalAvatar, dispatch_token, route_audio_to_worker, start_in_process)
from lipstream.integrations.livekit.generator import LipStreamVideoGenerator
from lipstream.integrations.livekit.worker import AvatarWorker, DispatchError

__all__ = ["AvatarError", "AvatarSession", "AvatarWorker", "DispatchError", "LipStreamVideoGenerator", "LocalAvatar",
           "dispatch_token", "route_audio_to_worker", "start_in_process"]
