"""`lipstream livekit-worker`: one engine, many rooms. An agent asks (HTTP), the avatar joins its room.

The agent side (`AvatarSession.start`) POSTs `/sessions` with the room's name and its own identity,
signed with the LiveKit project's secret (a short room token, `agent.dispatch_token`). The worker
opens a session on its engine, mints the avatar's own token (kind "agent", publishing on behalf
of the agent, as LiveKit's avatar plugins do), joins the room, and runs an `AvatarRunner` there:
the agent's speech arrives over the `lk.audio_stream` data stream (`DataStreamAudioReceiver`),
`lk.clear_buffer` interrupts it, `lk.playback_finished` goes back. The avatar leaves when the
agent does, when the room closes, or on `DELETE /sessions/{room}`; its place on the engine is freed.

The reply to a POST comes once the avatar is in the room, or with the reason it is not (one line):
401/403 a bad signature or another room's token, 404 an avatar not resident, 503 the engine is
full, 502 the LiveKit server refused or could not be reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from fractions import Fraction

from aiohttp import web
from livekit import api, rtc
from livekit.agents.types import ATTRIBUTE_PUBLISH_ON_BEHALF, TOPIC_TRANSCRIPTION
from livekit.agents.voice.avatar import AvatarRunner, DataStreamAudioReceiver

from lipstream.integrations.livekit.generator import LipStreamVideoGenerator
from lipstream.live import LiveEngine, SessionRefused

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 10.0
TOPIC_SESSION_MESSAGES = "lk.agent.session"  # the agent's session messages: not for the avatar


class DispatchError(Exception):
    """A request the worker refuses: its HTTP status and one line."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass
class Presence:
    """The avatar in one room: its session on the engine, its room connection, the task that runs it."""

    room_name: str
    identity: str
    agent_identity: str
    avatar: str
    room: rtc.Room
    session: object
    task: asyncio.Task | None = None
    stopped: asyncio.Event = field(default_factory=asyncio.Event)


class AvatarWorker:
    """Serves resident avatars to LiveKit rooms: `engine`'s (a LiveEngine in this process), or (`server`)
    those of the `lipstream serve` at that address, each room a WebRTC session of it (`server_key`: its
    key), so the rooms' runners do not share a GIL with an engine's core thread. `url`, `api_key`,
    `api_secret`: the LiveKit project; `avatar`: the one used when a request names none; `fps` (None: the
    avatar's) and `size` (None: the avatar's) of the pictures. `await start()`, then `await close()`."""

    def __init__(self, engine: LiveEngine | None = None, *, url: str, api_key: str, api_secret: str, avatar: str,
                 fps: Fraction | None = None, size: tuple[int, int] | None = None,
                 host: str = "127.0.0.1", port: int = 8089, server: str | None = None, server_key: str | None = None):
        if (engine is None) == (server is None):
            raise ValueError("engine, server: exactly one is allowed")
        self.engine, self.url, self.avatar, self.fps, self.size = engine, url, avatar, fps, size
        self.server, self._server_key = server, server_key
        self._key, self._secret = api_key, api_secret
        self.host, self.port = host, port
        self.rooms: dict[str, Presence] = {}
        self._verifier = api.TokenVerifier(api_key, api_secret)
        self._runner: web.AppRunner | None = None

    # --- HTTP ----------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/sessions", self._post_session)
        app.router.add_delete("/sessions/{room}", self._delete_session)
        app.router.add_post("/sessions/{room}/avatar", self._switch_avatar)
        app.router.add_get("/health", self._health)
        return app

    async def start(self) -> str:
        """Listen; returns the address agents call (http://HOST:PORT; port 0 picks a free one)."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        for name in list(self.rooms):
            await self.leave(name)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _post_session(self, request: web.Request) -> web.Response:
        try:
            try:
                body = await request.json()
            except ValueError:
                raise DispatchError(400, "the body is not JSON") from None
            if not isinstance(body, dict):
                raise DispatchError(400, "the body must be a JSON object")
            room, agent = body.get("room"), body.get("agent_identity")
            identity, avatar = body.get("avatar_identity") or "lipstream-avatar", body.get("avatar") or self.avatar
            for name, value in (("room", room), ("agent_identity", agent), ("avatar_identity", identity),
                                ("avatar", avatar)):
                if not isinstance(value, str) or not 0 < len(value) <= 256:
                    raise DispatchError(400, f"{name}: a string of 1 to 256 characters is required")
            self._authorise(request, room)
            presence = await self.join(room, agent, identity, avatar)
        except DispatchError as e:
            return web.json_response({"error": str(e)}, status=e.status)
        return web.json_response({"room": presence.room_name, "identity": presence.identity,
                                  "avatar": presence.avatar})

    async def _delete_session(self, request: web.Request) -> web.Response:
        room = request.match_info["room"]
        try:
            self._authorise(request, room)
        except DispatchError as e:
            return web.json_response({"error": str(e)}, status=e.status)
        return web.json_response({"room": room, "left": await self.leave(room)})

    async def _switch_avatar(self, request: web.Request) -> web.Response:
        """A camera cut in a room: {"avatar": NAME} -> {"room", "avatar", "frame": the frame it lands on}."""
        room = request.match_info["room"]
        try:
            self._authorise(request, room)
            try:
                body = await request.json()
            except ValueError:
                raise DispatchError(400, "the body is not JSON") from None
            avatar = body.get("avatar") if isinstance(body, dict) else None
            if not isinstance(avatar, str) or not 0 < len(avatar) <= 256:
                raise DispatchError(400, "avatar: a string of 1 to 256 characters is required")
            presence = self.rooms.get(room)
            if presence is None:
                raise DispatchError(404, f"no avatar in room {room!r}")
            try:
                frame = (presence.session.switch(avatar) if self.server is None
                         else await presence.session.aswitch(avatar))
            except ValueError as e:
                raise DispatchError(422, str(e)) from None
            except TimeoutError as e:
                raise DispatchError(504, str(e)) from None
        except DispatchError as e:
            return web.json_response({"error": str(e)}, status=e.status)
        presence.avatar = avatar
        return web.json_response({"room": room, "avatar": avatar, "frame": frame})

    async def _health(self, request: web.Request) -> web.Response:
        if self.server is not None:
            return web.json_response({"server": self.server, "rooms": len(self.rooms), "sessions": len(self.rooms)})
        return web.json_response({"avatars": [a.name for a in self.engine.engine.avatars], "rooms": len(self.rooms),
                                  "sessions": len(self.engine.sessions)})

    def _authorise(self, request: web.Request, room: str) -> None:
        """The caller holds the project's secret: a room token for this room, signed with it."""
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer "):
            raise DispatchError(401, "a LiveKit token of this project is required (Authorization: Bearer)")
        try:
            claims = self._verifier.verify(header[7:])
        except Exception as e:  # noqa: BLE001 - jwt's errors: expired, bad signature, malformed
            raise DispatchError(401, f"the token is not valid for this LiveKit project ({type(e).__name__})") from None
        if claims.video is None or claims.video.room != room:
            raise DispatchError(403, f"the token is for room {getattr(claims.video, 'room', '')!r}, not {room!r}")

    # --- rooms ---------------------------------------------------------------------------------

    def room_token(self, room: str, identity: str, agent_identity: str) -> str:
        """The avatar's own token: joins `room` as an agent participant publishing for the agent."""
        return (api.AccessToken(self._key, self._secret).with_identity(identity).with_name("LipStream avatar")
                .with_kind("agent").with_attributes({ATTRIBUTE_PUBLISH_ON_BEHALF: agent_identity})
                .with_grants(api.VideoGrants(room_join=True, room=room)).to_jwt())

    async def join(self, room_name: str, agent_identity: str, identity: str, avatar: str) -> Presence:
        """Open a session, join the room, start publishing; DispatchError (one line) when it cannot."""
        if self.server is None:
            try:
                index = self.engine.avatar_index(avatar)
            except ValueError as e:
                raise DispatchError(404, str(e)) from None
        if room_name in self.rooms:  # the agent came back (a restart, a swap): the old avatar leaves first
            await self.leave(room_name)
        session = await self._open(index if self.server is None else avatar)
        room = rtc.Room()
        try:
            await room.connect(self.url, self.room_token(room_name, identity, agent_identity),
                               rtc.RoomOptions(auto_subscribe=False, connect_timeout=CONNECT_TIMEOUT_S))
        except Exception as e:  # noqa: BLE001 - rtc.ConnectError, or the FFI's own errors
            await session.aclose()
            text = str(e).strip().splitlines()
            raise DispatchError(502, f"LiveKit server at {self.url}: {text[0] if text else type(e).__name__}") from None
        presence = Presence(room_name, identity, agent_identity, avatar, room, session)
        self.rooms[room_name] = presence
        presence.task = asyncio.create_task(self._serve(presence), name=f"lipstream-avatar-{room_name}")
        log.info("avatar %s joined room %s for %s", avatar, room_name, agent_identity)
        return presence

    async def _open(self, avatar: int | str):
        """The room's session: on the engine here, or on the server (a refusal keeps the server's status)."""
        try:
            if self.server is None:
                return self.engine.open_session(avatar, fps=self.fps, encode=False)
            from lipstream.client import connect

            return await connect(self.server, avatar, api_key=self._server_key, fps=self.fps)
        except SessionRefused as e:
            status = (e.status or 503) if self.server is None else e.status if e.status in (404, 503) else 502
            raise DispatchError(status, e.detail) from None

    async def leave(self, room_name: str) -> bool:
        presence = self.rooms.get(room_name)
        if presence is None:
            return False
        presence.stopped.set()
        if presence.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await presence.task
        return True

    async def _serve(self, p: Presence) -> None:
        """Publish until the agent leaves, the room closes or leave() is called; then free everything."""
        room = p.room
        # the agent's transcriptions and session messages reach every participant: not ours to read
        room.register_text_stream_handler(TOPIC_TRANSCRIPTION, lambda reader, who: None)
        room.register_byte_stream_handler(TOPIC_SESSION_MESSAGES, lambda reader, who: None)
        room.on("participant_disconnected",
                lambda participant: participant.identity == p.agent_identity and p.stopped.set())
        room.on("disconnected", lambda *args: p.stopped.set())
        generator = LipStreamVideoGenerator(p.session, size=self.size)
        runner = AvatarRunner(room, audio_recv=DataStreamAudioReceiver(room, sender_identity=p.agent_identity),
                              video_gen=generator, options=generator.avatar_options())

        async def run() -> None:
            await runner.start()  # waits for the agent in the room
            await runner.wait_for_complete()

        work = asyncio.create_task(run())
        stop = asyncio.create_task(p.stopped.wait())
        try:
            await asyncio.wait({work, stop}, return_when=asyncio.FIRST_COMPLETED)
            if work.done() and work.exception() is not None:
                log.warning("avatar in room %s stopped: %s", p.room_name, work.exception())
        finally:
            for t in (work, stop):
                t.cancel()
            await asyncio.gather(work, stop, return_exceptions=True)
            with contextlib.suppress(Exception):
                await runner.aclose()
            with contextlib.suppress(Exception):
                await room.disconnect()
            await p.session.aclose()
            if self.rooms.get(p.room_name) is p:
                del self.rooms[p.room_name]
            log.info("avatar left room %s", p.room_name)


def run_worker(models, avatars: list, *, url: str, api_key: str, api_secret: str, options, fps: Fraction | None = None,
               size: tuple[int, int] | None = None, host: str = "127.0.0.1", port: int = 8089, inductor: str = "off",
               server: str | None = None, server_key: str | None = None, progress=print) -> None:
    """`lipstream livekit-worker`: the engine with these avatars (folders) resident, serving rooms until
    Ctrl-C; or (`server`, models None) the rooms' sessions on that `lipstream serve`, `avatars` its names."""
    import sys

    if server is not None:
        worker = AvatarWorker(url=url, api_key=api_key, api_secret=api_secret, avatar=avatars[0], fps=fps, size=size,
                              host=host, port=port, server=server, server_key=server_key)
        asyncio.run(_serve_until_stopped(worker, f"avatars {', '.join(avatars)} of the server {server}", progress))
        return
    # the rooms' event loop shares the GIL with the engine's core thread: wake it on time
    sys.setswitchinterval(0.001)
    engine = LiveEngine(models, options.replace(encode=False), inductor=inductor)
    try:
        names = [engine.engine.avatars[engine.add_avatar(folder)].name for folder in avatars]
        engine.start()
        worker = AvatarWorker(engine, url=url, api_key=api_key, api_secret=api_secret, avatar=names[0], fps=fps,
                              size=size, host=host, port=port)
        asyncio.run(_serve_until_stopped(worker, f"avatars {', '.join(names)} on {engine.device}", progress))
    finally:
        engine.close()


async def _serve_until_stopped(worker: AvatarWorker, what: str, progress) -> None:
    address = await worker.start()
    progress(f"livekit-worker: {what}; agents call {address}/sessions (LiveKit server {worker.url}); Ctrl-C stops")
    try:
        await asyncio.Event().wait()
    finally:
        await worker.close()
