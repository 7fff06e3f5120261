"""One load-test client of `lipstream serve`, in a process of its own: a WebRTC viewer that speaks.

It does what a voice agent's front end does: posts an SDP offer for a presenter, receives the audio
and video tracks (aiortc decodes them, as a browser would), and speaks over the session's WebSocket
in 20 ms PCM16 chunks on the wall clock, with pauses between utterances. It measures, at the
client, each speech frame's latency: from the moment it sent the audio at that frame's start to the
moment the frame arrived. Frames are matched to the audio by the server's speech events (the
frame an utterance started at) and the stream's own timestamps (aiortc's receiver counts them from
the first packet, which is the session's frame 0). The audio-video offset at the client checks that
match: a wrong anchor would show as an offset of whole frames.

Two arrival times a frame: when its last RTP packet (the marker) came in, which is when any client
can decode it, and when aiortc's receiver handed it over decoded. aiortc's jitter buffer holds
each frame until the next frame's first packet arrives (one frame interval; a browser goes by the
marker bit instead), so the second is the first plus about 1 / fps plus the decode.

    python -m lipstream.bench.serve_client --url http://127.0.0.1:8000 --avatar anna --start EPOCH \
        --seconds 12 --out client.json    (the key, if any, in LIPSTREAM_API_KEY)

No torch here: a client costs what a real one would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from fractions import Fraction
from pathlib import Path

import httpx
import numpy as np

from lipstream.aio import wait_for

RATE = 16_000
DRAIN_S = 2.0  # after the last utterance: its last frames still arrive


class Recorder:
    """Arrival times of a track's frames, by their media time (seconds from the stream's first frame)."""

    def __init__(self) -> None:
        self.arrivals: dict[int, float] = {}  # pts -> time.monotonic()
        self.clock = 1
        self.peak = 0.0  # loudest sample (audio): the speech came back

    async def run(self, track, until: float, audio: bool = False) -> None:
        from aiortc.mediastreams import MediaStreamError

        while time.monotonic() < until:
            try:
                frame = await wait_for(track.recv(), timeout=max(0.01, until - time.monotonic()))
            except (asyncio.TimeoutError, MediaStreamError):
                return
            now = time.monotonic()
            self.clock = frame.time_base.denominator // max(1, frame.time_base.numerator)
            self.arrivals.setdefault(int(frame.pts), now)
            if audio:
                self.peak = max(self.peak, float(np.abs(frame.to_ndarray()).max()))

    def lag(self) -> float | None:
        """Median arrival minus media time: its difference between tracks is the A/V offset."""
        if not self.arrivals:
            return None
        return float(np.median([at - pts / self.clock for pts, at in self.arrivals.items()]))


class WireClock:
    """When each video frame's last RTP packet (`frames`: the marker ends a frame) or each audio packet
    arrived, by media time from the stream's first packet: a hook on the receiver's packet handler (it
    measures, it changes nothing). Before aiortc's buffering, which is not the same for both tracks:
    its audio jitter buffer hands a packet over once 4 are in (60-80 ms), its video one holds a frame
    until the next starts (one frame), so decoded arrivals show an A/V offset the sender did not make."""

    def __init__(self, receiver, clock: int, frames: bool = True) -> None:
        self.arrivals: dict[int, float] = {}
        self.origin: int | None = None
        self.clock = clock
        handle = receiver._handle_rtp_packet

        async def timed(packet, arrival_time_ms: int) -> None:
            if self.origin is None:
                self.origin = packet.timestamp
            if packet.marker or not frames:
                self.arrivals.setdefault((packet.timestamp - self.origin) % (1 << 32), time.monotonic())
            await handle(packet, arrival_time_ms)

        receiver._handle_rtp_packet = timed

    def lag(self) -> float | None:
        """Median arrival minus media time."""
        if not self.arrivals:
            return None
        return float(np.median([at - ts / self.clock for ts, at in self.arrivals.items()]))


async def _speak(ws, speech: np.ndarray, rng: np.random.Generator, start: float, until: float,
                 sent: list[list[float]], chunk_s: float) -> None:
    """Utterances of 2-5 s after pauses of 0.5-1.5 s; each chunk's send time kept (absolute pacing)."""
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    await ws.send(json.dumps({"type": "start", "rate": RATE}))
    step = round(RATE * chunk_s)
    while time.monotonic() < until - 2.0:
        await asyncio.sleep(rng.uniform(0.5, 1.5))
        clip = speech[rng.integers(0, speech.size - 5 * RATE):][:int(rng.uniform(2.0, 5.0) * RATE)]
        times: list[float] = []
        t0 = time.monotonic()
        for k, i in enumerate(range(0, clip.size, step)):
            await asyncio.sleep(max(0.0, t0 + k * chunk_s - time.monotonic()))
            await ws.send(clip[i:i + step].tobytes())
            times.append(time.monotonic())
        await ws.send(json.dumps({"type": "end"}))
        sent.append(times)


def latencies(sent: list[list[float]], events: list[dict], video: dict[int, float], clock: int,
              fps: Fraction, chunk_s: float = 0.02) -> list[float]:
    """Per speech frame (seconds): its arrival minus the send time of the audio at its start."""
    started = [e for e in events if e.get("kind") == "started"]
    ended = {e["utterance"]: e["frame"] for e in events if e.get("kind") in ("finished", "interrupted")}
    out = []
    for times, e in zip(sent, started):  # utterances start in the order they were sent
        first, last = e["frame"], ended.get(e["utterance"], e["frame"] + int(len(times) * chunk_s * fps))
        for frame in range(first, last):
            chunk = int((frame - first) / fps / chunk_s + 1e-9)
            arrived = video.get(int(frame * clock / fps))  # the server's own rounding
            if chunk < len(times) and arrived is not None:
                out.append(arrived - times[chunk])
    return out


async def run(url: str, key: str, avatar: str, start_epoch: float, seconds: float, seed: int,
              codec: str = "any", chunk_s: float = 0.02, playout_delay_ms: float | None = None,
              latency: str | None = None) -> dict:
    """Connect, wait for the common start, speak for `seconds`, and report what arrived. `codec`: the video
    codec the offer allows ("h264", "vp8"; "any": aiortc's own list, VP8 then H.264); `playout_delay_ms`:
    the session's own (None: the server's); `latency`: its latency choice ("low"; None: the server's)."""
    import websockets
    from aiortc import RTCPeerConnection, RTCRtpReceiver, RTCSessionDescription

    from lipstream.fixtures import speech_like

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    speech = (speech_like(30.0, RATE, seed=seed) * 32767).astype("<i2")
    pc = RTCPeerConnection()
    tracks: dict = {}
    pc.on("track", lambda t: tracks.__setitem__(t.kind, t))
    transceiver = pc.addTransceiver("video", direction="recvonly")
    if codec != "any":
        transceiver.setCodecPreferences([c for c in RTCRtpReceiver.getCapabilities("video").codecs
                                         if c.mimeType.lower() in (f"video/{codec}", "video/rtx")])
    wire = WireClock(transceiver.receiver, 90_000)
    wire_audio = WireClock(pc.addTransceiver("audio", direction="recvonly").receiver, 48_000, frames=False)
    t_connect = time.monotonic()
    await pc.setLocalDescription(await pc.createOffer())
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as http:
        params = {"avatar": avatar} | ({} if playout_delay_ms is None else {"playout_delay_ms": playout_delay_ms}) \
            | ({} if latency is None else {"latency": latency})
        r = await http.post("/v1/sessions", params=params, content=pc.localDescription.sdp,
                            headers={"Content-Type": "application/sdp"})
        if r.status_code != 201:
            await pc.close()
            return {"error": f"POST /v1/sessions: {r.status_code} {r.text[:200]}"}
        sid = r.headers["x-session-id"]
        video_line = r.text.split("m=video", 1)[1].split("\n", 1)[0].split()
        answered = next((line.split()[1].split("/")[0] for line in r.text.splitlines()
                         if line.startswith(f"a=rtpmap:{video_line[2]} ")), "?")  # the codec it sends
        fps = next(Fraction(a["fps"]) for a in (await http.get("/v1/avatars")).json() if a["name"] == avatar)
        await pc.setRemoteDescription(RTCSessionDescription(r.text, "answer"))
        while len(tracks) < 2 and time.monotonic() - t_connect < 30:
            await asyncio.sleep(0.01)
        start = time.monotonic() + (start_epoch - time.time())
        until = start + seconds
        video, audio = Recorder(), Recorder()
        recorders = [asyncio.ensure_future(video.run(tracks["video"], until + DRAIN_S)),
                     asyncio.ensure_future(audio.run(tracks["audio"], until + DRAIN_S, audio=True))]
        events: list[dict] = []
        sent: list[list[float]] = []
        ws_url = url.replace("http", "ws", 1) + f"/v1/sessions/{sid}/speech" + (f"?token={key}" if key else "")
        async with websockets.connect(ws_url, max_size=None) as ws:
            async def listen() -> None:
                async for message in ws:
                    events.append({**json.loads(message), "at": time.monotonic()})

            listener = asyncio.ensure_future(listen())
            await _speak(ws, speech, np.random.default_rng(seed), start, until, sent, chunk_s)
            await asyncio.gather(*recorders)
            listener.cancel()
        first_frame_s = (min(video.arrivals.values()) - t_connect) if video.arrivals else None
        status = await http.get(f"/v1/sessions/{sid}")
        server = status.json() if status.status_code == 200 else {}
        await http.delete(f"/v1/sessions/{sid}")
    await pc.close()
    lat = latencies(sent, events, video.arrivals, video.clock, fps, chunk_s)
    lat_wire = latencies(sent, events, wire.arrivals, video.clock, fps, chunk_s)
    # the frame's sound: the audio packet (and the decoded audio frame) that starts at the frame's first sample
    lat_audio = latencies(sent, events, wire_audio.arrivals, wire_audio.clock, fps, chunk_s)
    lat_audio_decoded = latencies(sent, events, audio.arrivals, audio.clock or 48_000, fps, chunk_s)
    v = sorted(video.arrivals)
    lags = video.lag(), audio.lag()
    wire_lags = wire.lag(), wire_audio.lag()
    return {
        "session": sid, "avatar": avatar, "fps": str(fps), "video_codec": answered,
        "first_frame_s": first_frame_s and round(first_frame_s, 3),  # offer made -> first video frame
        "latency_ms": [round(x * 1000, 1) for x in lat_wire],  # the frame's last packet in
        "decoded_latency_ms": [round(x * 1000, 1) for x in lat],  # handed over by aiortc, decoded
        "audio_latency_ms": [round(x * 1000, 1) for x in lat_audio],  # the frame's first audio packet in
        "decoded_audio_latency_ms": [round(x * 1000, 1) for x in lat_audio_decoded],
        "utterances_sent": len(sent),
        "utterances_started": sum(e.get("kind") == "started" for e in events),
        "utterances_finished": sum(e.get("kind") == "finished" for e in events),
        "video_frames": len(v),
        "video_frames_missing": (round((v[-1] - v[0]) * fps / video.clock) + 1 - len(v)) if v else None,
        "audio_frames": len(audio.arrivals),
        "audio_peak": round(audio.peak, 1),
        # video minus audio, as the packets came in (what the server sent) and as aiortc handed them over decoded
        "av_offset_ms": round(1000 * (wire_lags[0] - wire_lags[1]), 1) if None not in wire_lags else None,
        "av_offset_decoded_ms": round(1000 * (lags[0] - lags[1]), 1) if None not in lags else None,
        "server_frames_played": server.get("stats", {}).get("played"),
        "server_frames_late": server.get("stats", {}).get("late"),
        "server_stats": server.get("stats"),
        "server_playout_delay_ms": server.get("playout_delay_ms"),
        "server_window_ahead_ms": server.get("window_ahead_ms"),
        "server_timings_ms": server.get("timings_ms"),  # per speech frame, by stage (serve/app.py)
        "cpu_s": round(sum(os.times()[:2]), 2),  # this client process: what N of them cost the machine
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", required=True)
    p.add_argument("--avatar", required=True)
    p.add_argument("--start", type=float, required=True, help="time.time() at which to start speaking")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codec", choices=("any", "h264", "vp8"), default="any")
    p.add_argument("--chunk-ms", type=float, default=20.0, help="speech sent in chunks of this length")
    p.add_argument("--playout-delay-ms", type=float, default=None, help="the session's (default: the server's)")
    p.add_argument("--latency", default=None, help="the session's latency choice (default: the server's)")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    try:
        report = asyncio.run(run(a.url.rstrip("/"), os.environ.get("LIPSTREAM_API_KEY", ""), a.avatar, a.start,
                                 a.seconds, a.seed, a.codec, a.chunk_ms / 1000, a.playout_delay_ms, a.latency))
    except Exception as e:  # the parent reports it, with the others' figures
        report = {"error": f"{type(e).__name__}: {e}"}
    tmp = a.out.with_suffix(".part")
    tmp.write_text(json.dumps(report))
    tmp.replace(a.out)


if __name__ == "__main__":
    main()
