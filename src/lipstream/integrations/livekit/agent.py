"""The agent's side: an avatar in another process (`AvatarSession`, a `lipstream livekit-worker`), or in
this one (`start_in_process`, over a LiveEngine the agent's process holds or a `lipstream serve`'s session).

Both route the agent's TTS away from the room and into the avatar, as LiveKit's avatar plugins do
(`agent_session.output.replace_audio_tail`): over the `lk.audio_stream` data stream to the worker
(`DataStreamAudioOutput`), or through a queue to an `AvatarRunner` running here (`QueueAudioOutput`).
The avatar publishes the speech with its pictures, and tells the agent where playback stopped.
Start the avatar before `agent_session.start(...)`.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from fractions import Fraction

import aiohttp
from livekit import api, rtc
from livekit.agents import AgentSession, get_job_context
from livekit.agents.voice.avatar import (
    AvatarRunner, AvatarSession as BaseAvatarSession, DataStreamAudioOutput, QueueAudioOutput)

from lipstream.errors import LipStreamError
from lipstream.integrations.livekit.generator import LipStreamVideoGenerator

log = logging.getLogger(__name__)
DEFAULT_IDENTITY = "lipstream-avatar"
DISPATCH_TOKEN_TTL = datetime.timedelta(minutes=5)


class AvatarError(LipStreamError):
    """The avatar could not be started (the worker refused, or could not join the room): one line."""


def dispatch_token(room: str, agent_identity: str, api_key: str, api_secret: str) -> str:
    """What the agent shows the worker: a short LiveKit token for the room, signed with the project's
    secret, so only the project's own agents can send the avatar into its rooms."""
    return (api.AccessToken(api_key, api_secret).with_identity(agent_identity).with_ttl(DISPATCH_TOKEN_TTL)
            .with_grants(api.VideoGrants(room_join=True, room=room)).to_jwt())


class AvatarSession(BaseAvatarSession):
    """A LipStream avatar served by a `lipstream livekit-worker`:
    `await AvatarSession(worker_url="http://gpu-box:8089", avatar="anna").start(agent_session, ctx.room)`.

    `worker_url`: the worker's address; `avatar`: a resident avatar's name (None: the worker's
    default); `avatar_identity`: the avatar participant's identity in the room. `api_key` /
    `api_secret` (default $LIVEKIT_API_KEY / $LIVEKIT_API_SECRET, the same project as the worker's)
    sign the request to the worker.
    """

    def __init__(self, *, worker_url: str, avatar: str | None = None, avatar_identity: str = DEFAULT_IDENTITY,
                 api_key: str | None = None, api_secret: str | None = None, timeout_s: float = 30.0):
        super().__init__()
        if not worker_url.startswith(("http://", "https://")):
            raise ValueError(f"worker_url: {worker_url!r}; http://HOST:PORT is allowed")
        self.worker_url = worker_url.rstrip("/")
        self.avatar = avatar
        self._identity = avatar_identity
        self._api_key = api_key or os.environ.get("LIVEKIT_API_KEY", "")
        self._api_secret = api_secret or os.environ.get("LIVEKIT_API_SECRET", "")
        self._timeout_s = timeout_s
        self._room_name = ""

    @property
    def avatar_identity(self) -> str:
        return self._identity

    @property
    def provider(self) -> str:
        return "lipstream"

    async def start(self, agent_session: AgentSession, room: rtc.Room) -> None:
        """Ask the worker to join this room, then send the agent's speech to it (not to the room)."""
        if not self._api_key or not self._api_secret:
            raise AvatarError("api_key and api_secret (or $LIVEKIT_API_KEY and $LIVEKIT_API_SECRET) are needed "
                              "to sign the request to the avatar worker")
        room_name, agent_identity = room_and_agent(room)
        await super().start(agent_session, room)
        await self._dispatch(room_name, agent_identity)
        self._room_name = room_name
        route_audio_to_worker(agent_session, room, self._identity)

    async def _dispatch(self, room_name: str, agent_identity: str) -> dict:
        body = {"room": room_name, "agent_identity": agent_identity, "avatar_identity": self._identity,
                "avatar": self.avatar}
        token = dispatch_token(room_name, agent_identity, self._api_key, self._api_secret)
        return await _call(self.worker_url, "POST", "/sessions", token, self._timeout_s, body)

    async def swap_avatar(self, avatar: str) -> int:
        """A camera cut: the worker's session for this room switches to another of its resident avatars of
        the same frame size, with the speech going on; the frame it lands on. AvatarError if refused."""
        if not self._room_name:
            raise AvatarError("the avatar has not been started (`await avatar.start(agent_session, room)`)")
        token = dispatch_token(self._room_name, "agent", self._api_key, self._api_secret)
        reply = await _call(self.worker_url, "POST", f"/sessions/{self._room_name}/avatar", token, self._timeout_s,
                            {"avatar": avatar})
        self.avatar = avatar
        return int(reply["frame"])

    async def aclose(self) -> None:
        """Remove the avatar from the room (the worker frees its session when it leaves)."""
        if self._room_name:
            name, self._room_name = self._room_name, ""
            try:
                await _call(self.worker_url, "DELETE", f"/sessions/{name}",
                            dispatch_token(name, "agent", self._api_key, self._api_secret), 5.0)
            except AvatarError as e:
                log.warning("avatar worker: %s", e)
        await super().aclose()


async def _call(base: str, method: str, path: str, token: str, timeout_s: float, body: dict | None = None) -> dict:
    """One request to the worker; its refusal or an unreachable worker as an AvatarError (one line)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http, \
                http.request(method, base + path, json=body, headers={"Authorization": f"Bearer {token}"}) as r:
            reply = await r.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        raise AvatarError(f"avatar worker at {base}: {type(e).__name__}: {_first_line(e)}") from None
    if not 200 <= r.status < 300:
        raise AvatarError(f"avatar worker at {base}: {(reply or {}).get('error') or f'HTTP {r.status}'}")
    return reply


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else "no details"


def room_and_agent(room: rtc.Room) -> tuple[str, str]:
    """The room's name and the agent's identity in it, from the room or (not connected yet) the job."""
    job = get_job_context(required=False)
    name = room.name or (job.job.room.name if job is not None else "")
    identity = ""
    if job is not None:
        try:
            identity = job.local_participant_identity
        except Exception:  # noqa: BLE001 - a fake or unconnected job has no token to read it from
            identity = job._info.accept_arguments.identity
    if not identity and room.isconnected():
        identity = room.local_participant.identity
    if not name or not identity:
        raise AvatarError("the room has no name or the agent no identity yet: connect first (`await ctx.connect()`)")
    return name, identity


def route_audio_to_worker(agent_session: AgentSession, room: rtc.Room, avatar_identity: str) -> DataStreamAudioOutput:
    """The agent's speech goes to the avatar over the `lk.audio_stream` data stream; the avatar answers
    `lk.playback_started` / `lk.playback_finished`, and a reply waits until its video is published."""
    sink = DataStreamAudioOutput(room, destination_identity=avatar_identity, wait_remote_track=rtc.TrackKind.KIND_VIDEO,
                                 wait_playback_start=True)
    agent_session.output.replace_audio_tail(sink)
    return sink


@dataclass
class LocalAvatar:
    """An avatar running in the agent's process (start_in_process); `aclose()` stops it and frees its session."""

    runner: AvatarRunner
    generator: LipStreamVideoGenerator
    audio: QueueAudioOutput
    session: object  # the SpeakingSession

    def swap_avatar(self, avatar: int | str) -> int:
        """A camera cut to another resident avatar of the same frame size, with the speech going on; the
        frame it lands on. ValueError if refused."""
        return self.session.switch(avatar)

    async def aclose(self) -> None:
        await self.runner.aclose()
        await self.session.aclose()


async def start_in_process(agent_session: AgentSession, room: rtc.Room, engine=None, avatar: int | str = 0, *,
                           url: str | None = None, api_key: str | None = None,
                           fps: Fraction | float | None = None, size: tuple[int, int] | None = None) -> LocalAvatar:
    """The avatar in this process: the agent's own participant publishes the avatar's video and speech.
    Its frames come from `engine` (a started LiveEngine this process holds; many agents share one) or
    from the `lipstream serve` at `url` (the engine in another process, usually on a GPU machine:
    LiveKit runs each job in a process of its own, so each room's runner then has a process and a GIL
    to itself; `api_key`: the server's key, default $LIPSTREAM_API_KEY). `avatar`: a resident avatar's
    name (or, on an engine, index); `fps` (None: the avatar's) and `size` (None: the avatar's) of the
    pictures. SessionRefused (lipstream.live) when the engine or the server is full."""
    if (engine is None) == (url is None):
        raise ValueError("engine, url: exactly one is allowed (a LiveEngine here, or a lipstream serve's address)")
    if url is None:
        session = engine.open_session(avatar, fps=fps, encode=False)
    else:
        from lipstream.client import connect

        if not isinstance(avatar, str):
            raise ValueError(f"avatar: {avatar!r}; with url=, a resident avatar's name is allowed")
        session = await connect(url, avatar, api_key=api_key or os.environ.get("LIPSTREAM_API_KEY") or None, fps=fps)
    try:
        generator = LipStreamVideoGenerator(session, size=size)
        audio = QueueAudioOutput(wait_playback_start=True)
        runner = AvatarRunner(room, audio_recv=audio, video_gen=generator, options=generator.avatar_options())
        await runner.start()
    except BaseException:
        session.close()
        raise
    agent_session.output.replace_audio_tail(audio)
    local = LocalAvatar(runner, generator, audio, session)
    job = get_job_context(required=False)
    if job is not None:
        job.add_shutdown_callback(local.aclose)
    return local
