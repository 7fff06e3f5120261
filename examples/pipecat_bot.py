"""A Pipecat bot with a LipStream face, in one command: open the page, press Start, watch it speak.

    python examples/pipecat_bot.py --avatar avatars/anna                 # real MuseTalk weights, GPU
    python examples/pipecat_bot.py --avatar avatars/anna --random-weights --model-size tiny --fps 5   # CPU try-out

Each browser that connects gets its own Pipecat pipeline, all on one LiveEngine in this process:

    speaker (a TTS stand-in) -> LipStreamVideoService -> SmallWebRTCTransport.output()

The TTS stand-in speaks a WAV (`--wav`), or a sentence with espeak-ng when it is installed, or a
generated voice-like signal, then pauses, then speaks again, until the browser leaves. Put a real
STT -> LLM -> TTS in front of LipStreamVideoService for a conversation. The page is served here
(no Pipecat front-end package needed); the WebRTC offer/answer goes through `POST /api/offer`.
Needs `pip install "lipstream[pipecat]"`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import tempfile
from pathlib import Path

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>LipStream + Pipecat</title>
<style>body{font-family:sans-serif;margin:2em;background:#111;color:#eee}video{background:#000;max-width:90vw}</style>
</head><body>
<h3>LipStream + Pipecat</h3>
<button id="start">Start</button> <span id="state"></span><br><br>
<video id="video" autoplay playsinline></video><audio id="audio" autoplay></audio>
<script>
document.getElementById("start").onclick = async () => {
  const state = document.getElementById("state");
  const pc = new RTCPeerConnection();
  pc.addTransceiver("audio", {direction: "recvonly"});
  pc.addTransceiver("video", {direction: "recvonly"});
  pc.ontrack = (e) => { document.getElementById(e.track.kind).srcObject = new MediaStream([e.track]); };
  pc.onconnectionstatechange = () => { state.textContent = pc.connectionState; };
  await pc.setLocalDescription(await pc.createOffer());
  await new Promise((done) => {
    if (pc.iceGatheringState === "complete") return done();
    pc.onicegatheringstatechange = () => { if (pc.iceGatheringState === "complete") done(); };
  });
  const r = await fetch("/api/offer", {method: "POST", headers: {"Content-Type": "application/json"},
                                       body: JSON.stringify({sdp: pc.localDescription.sdp, type: pc.localDescription.type})});
  if (!r.ok) { state.textContent = "offer refused: " + await r.text(); return; }
  await pc.setRemoteDescription(await r.json());
};
</script></body></html>
"""


def _speech(wav: str | None) -> tuple:
    """(int16 mono samples, rate, what made them): the WAV, else espeak-ng, else a generated voice-like signal."""
    import numpy as np

    from lipstream.audio.decode import decode_audio
    from lipstream.fixtures import espeak_speech

    if wav is None:
        wav, made_by = espeak_speech(Path(tempfile.mkdtemp(prefix="lipstream-bot-")) / "speech.wav",
                                     "Hello! I am a LipStream avatar in a Pipecat pipeline.", fallback_seconds=4.0)
    else:
        made_by = "wav"
    data, rate = decode_audio(wav)  # [channels, n]
    mono = data.astype(np.float32).mean(axis=0)
    if data.dtype == np.int16:
        mono = mono / 32768.0
    return (np.clip(mono, -1, 1) * 32767).astype(np.int16), int(rate), made_by


def build_app(engine, avatar: str | int, pcm, rate: int, *, fps=None, pause_s: float = 2.0):
    """The bot's web app: the page at /, one pipeline per WebRTC offer at POST /api/offer."""
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import HTMLResponse
    from pipecat.frames.frames import Frame, StartFrame, TTSAudioRawFrame, TTSStartedFrame, TTSStoppedFrame
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.worker import PipelineParams, PipelineWorker
    from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
    from pipecat.transports.base_transport import TransportParams
    from pipecat.transports.smallwebrtc.connection import SmallWebRTCConnection
    from pipecat.transports.smallwebrtc.transport import SmallWebRTCTransport
    from pipecat.workers.runner import WorkerRunner

    from lipstream.integrations.pipecat import LipStreamVideoService

    class Speaker(FrameProcessor):
        """A TTS stand-in: the clip in 20 ms chunks at real-time pace, a pause, again."""

        def __init__(self):
            super().__init__()
            self._task = None

        async def process_frame(self, frame: Frame, direction: FrameDirection):
            await super().process_frame(frame, direction)
            await self.push_frame(frame, direction)
            if isinstance(frame, StartFrame) and self._task is None:
                self._task = self.create_task(self._speak())

        async def _speak(self):
            step = rate // 50
            await asyncio.sleep(1.0)
            loop = asyncio.get_running_loop()
            while True:
                await self.push_frame(TTSStartedFrame())
                t = loop.time()
                for k, i in enumerate(range(0, pcm.size, step)):
                    await self.push_frame(TTSAudioRawFrame(audio=pcm[i:i + step].tobytes(), sample_rate=rate,
                                                           num_channels=1))
                    await asyncio.sleep(max(0.0, t + (k + 1) * 0.02 - loop.time()))
                await self.push_frame(TTSStoppedFrame())
                await asyncio.sleep(pause_s)

        async def cleanup(self):
            await super().cleanup()
            if self._task is not None:
                await self.cancel_task(self._task)

    app = FastAPI()
    bots: set[asyncio.Task] = set()

    @app.get("/", response_class=HTMLResponse)
    async def page():
        return PAGE

    @app.post("/api/offer")
    async def offer(body: dict):
        if body.get("type") != "offer" or not isinstance(body.get("sdp"), str):
            raise HTTPException(400, "a JSON body {sdp, type: 'offer'} is expected")
        connection = SmallWebRTCConnection()
        await connection.initialize(sdp=body["sdp"], type=body["type"])
        video = LipStreamVideoService(engine=engine, avatar=avatar, fps=fps)
        # the size and rate the transport sends must be the pictures': known from the avatar now
        width, height = engine.engine.avatars[engine.avatar_index(avatar)].size
        frame_rate = round(float(fps or engine.engine.avatars[engine.avatar_index(avatar)].fps))
        transport = SmallWebRTCTransport(webrtc_connection=connection, params=TransportParams(
            audio_out_enabled=True, audio_out_sample_rate=48_000, video_out_enabled=True,
            video_out_width=width, video_out_height=height, video_out_framerate=frame_rate))
        worker = PipelineWorker(Pipeline([Speaker(), video, transport.output()]),
                                params=PipelineParams(audio_out_sample_rate=48_000), cancel_on_idle_timeout=False)

        @transport.event_handler("on_client_disconnected")
        async def gone(transport, client):
            await worker.cancel()

        runner = WorkerRunner(handle_sigint=False)
        await runner.add_workers(worker)
        task = asyncio.create_task(runner.run())
        bots.add(task)
        task.add_done_callback(bots.discard)
        return connection.get_answer()

    app.state.bots = bots
    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A Pipecat bot with a LipStream face (SmallWebRTC, one page).")
    p.add_argument("--avatar", required=True, help="a compiled avatar folder (lipstream compile VIDEO)")
    p.add_argument("--wav", default=None, help="what the bot says (default: espeak-ng if installed, else a generated voice)")
    p.add_argument("--models", default=None, help="the MuseTalk folder (default: lipstream's default place)")
    p.add_argument("--random-weights", action="store_true", help="untrained networks: to try the pipeline, not to look at")
    p.add_argument("--model-size", default="full", choices=["full", "tiny"], help="with --random-weights")
    p.add_argument("--device", default="auto")
    p.add_argument("--fps", type=float, default=None, help="frames a second (default: the avatar's)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7860)
    a = p.parse_args(argv)
    avatar = Path(a.avatar)
    if not (avatar / "avatar.json").is_file():
        print(f"pipecat_bot: --avatar {avatar}: not a compiled avatar folder (make one with `lipstream compile VIDEO`)",
              file=sys.stderr)
        return 2
    if a.wav is not None and not Path(a.wav).is_file():
        print(f"pipecat_bot: --wav {a.wav}: no such file", file=sys.stderr)
        return 2
    missing = [m for m in ("pipecat", "aiortc", "fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        print(f"pipecat_bot: {', '.join(missing)} missing: pip install 'lipstream[pipecat]'", file=sys.stderr)
        return 2
    import uvicorn
    from lipstream.live import preset, start_engine
    from lipstream.engine.networks import pick_device

    device = pick_device(a.device)
    options = preset("realtime" if device.type == "cuda" else "cpu").replace(encode=False)
    pcm, rate, made_by = _speech(a.wav)
    print(f"pipecat_bot: speaking {pcm.size / rate:.1f} s of {made_by} speech; loading the engine ...", file=sys.stderr)
    with start_engine([avatar], models=a.models, random_weights=a.random_weights, size=a.model_size,
                      device=str(device), options=options) as engine:
        app = build_app(engine, 0, pcm, rate, fps=a.fps)
        print(f"pipecat_bot: open http://{a.host}:{a.port}/ and press Start", file=sys.stderr)
        uvicorn.run(app, host=a.host, port=a.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
