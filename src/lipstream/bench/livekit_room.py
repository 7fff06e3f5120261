"""The room LiveKit's AvatarRunner publishes into when no LiveKit server is there: the load bench's, and the one
mock of tests/test_livekit.py (no LiveKit server can run on the test machines)."""

from __future__ import annotations

from livekit import rtc

TTS_RATE = 24_000  # the sample rate of the bench's speech, and of the audio tracks made for the runners


class _Publication:
    async def wait_for_subscription(self) -> None:
        return None


class _Participant:
    def __init__(self, identity: str):
        self.identity = identity
        self.published: list = []  # the tracks AvatarRunner published

    async def publish_track(self, track, options) -> _Publication:
        self.published.append(track)
        return _Publication()


class RoomWithoutServer:
    """What AvatarRunner needs of an rtc.Room when no server is there: connected; published tracks are kept,
    and go nowhere (the bench's room, and the one mock of tests/test_livekit.py)."""

    def __init__(self, name: str = "bench", identity: str = "bench-agent"):
        self.name = name
        self.local_participant = _Participant(identity)

    def isconnected(self) -> bool:
        return True

    def on(self, event, callback=None):
        return callback

    def off(self, event, callback) -> None:
        pass


class RoomTracks:
    """The tracks AvatarRunner publishes, made before any session opens, handed out as it asks for them.

    A connected room holds LiveKit's WebRTC runtime (its peer-connection factory), so the tracks a runner makes
    at its first picture cost little. `RoomWithoutServer` connects nowhere and holds none: each track made then
    builds a factory on the calling thread, probing NVIDIA's codecs, and on a GPU host with 16 room processes
    that held each room's event loop 6-9 s after its session opened (the server then closed the session:
    its client stopped answering ICE). Published to `RoomWithoutServer` a track goes nowhere, so tracks of
    sources of their own, made first, stand in for the runner's."""

    def __init__(self, n: int):
        self._made = {rtc.LocalVideoTrack: [rtc.LocalVideoTrack.create_video_track("bench", rtc.VideoSource(16, 16))
                                            for _ in range(n)],
                      rtc.LocalAudioTrack: [rtc.LocalAudioTrack.create_audio_track("bench", rtc.AudioSource(TTS_RATE, 1))
                                            for _ in range(n)]}
        self._makers = {kind: kind.__dict__[name] for kind, name in ((rtc.LocalVideoTrack, "create_video_track"),
                                                                     (rtc.LocalAudioTrack, "create_audio_track"))}
        for kind, maker in self._makers.items():
            setattr(kind, maker.__func__.__name__, staticmethod(self._taker(kind, maker.__func__)))

    def _taker(self, kind, make):
        def take(name, source):
            return self._made[kind].pop() if self._made[kind] else make(name, source)
        return take

    def close(self) -> None:
        """LiveKit's own track makers back."""
        for kind, maker in self._makers.items():
            setattr(kind, maker.__func__.__name__, maker)
