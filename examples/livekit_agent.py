"""A LiveKit agent with a LipStream avatar: the avatar joins the room and speaks the agent's replies.

Against a local LiveKit server, no cloud account and no LLM/TTS keys (a recording stands in for the TTS):

    livekit-server --dev                # ws://127.0.0.1:7880, API key devkey, secret secret
    export LIVEKIT_URL=ws://127.0.0.1:7880 LIVEKIT_API_KEY=devkey LIVEKIT_API_SECRET=secret

    # the avatar worker (the GPU machine; it holds the engine and serves many rooms)
    lipstream livekit-worker --avatar anna --avatars avatars          # add --random-weights to try it untrained

    # this agent, in dev mode: it waits for rooms and joins each one a participant opens
    LIPSTREAM_WORKER_URL=http://127.0.0.1:8089 LIPSTREAM_AVATAR=anna python examples/livekit_agent.py dev

    # a viewer: a token for room "demo", then https://meet.livekit.io (Custom: the URL and the token)
    lk token create --api-key devkey --api-secret secret --join --room demo --identity viewer --valid-for 24h

The avatar says the greeting, then repeats it every 20 s. In-process instead of a worker (the engine in
this process, shared by every room this agent serves): LIPSTREAM_IN_PROCESS=avatars/anna (add
LIPSTREAM_RANDOM_WEIGHTS=1 to try it untrained). With real STT/LLM/TTS plugins, give AgentSession
its stt/llm/tts as usual and drop `say_greeting`: the avatar speaks whatever the TTS makes.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from collections.abc import AsyncIterator

import numpy as np
from livekit import rtc
from livekit.agents import Agent, AgentServer, AgentSession, JobContext, JobExecutorType, cli

from lipstream.audio.decode import load_audio
from lipstream.fixtures import espeak_speech
from lipstream.integrations.livekit import AvatarSession, start_in_process

GREETING = "Hello! I am a LipStream avatar, speaking in this LiveKit room."
RATE = 24_000

_engine = None
_engine_lock = threading.Lock()


def shared_engine():
    """In-process mode: one engine for every room this process serves (jobs run as threads here)."""
    global _engine
    with _engine_lock:
        if _engine is None:
            from lipstream.live import start_engine

            _engine = start_engine([os.environ["LIPSTREAM_IN_PROCESS"]],
                                   random_weights=os.environ.get("LIPSTREAM_RANDOM_WEIGHTS") == "1")
        return _engine


def greeting_pcm() -> np.ndarray:
    """The greeting as 24 kHz int16: espeak-ng when installed, else generated speech-like sound."""
    wav, _ = espeak_speech(os.path.join(tempfile.mkdtemp(), "greeting.wav"), GREETING)
    return (np.clip(load_audio(wav, RATE), -1, 1) * 32767).astype(np.int16)


async def frames(pcm: np.ndarray) -> AsyncIterator[rtc.AudioFrame]:
    """20 ms frames, as a TTS hands them over."""
    step = RATE // 50
    for i in range(0, pcm.size, step):
        chunk = pcm[i:i + step]
        yield rtc.AudioFrame(chunk.tobytes(), RATE, 1, chunk.size)


server = AgentServer(job_executor_type=JobExecutorType.THREAD)


@server.rtc_session()
async def entrypoint(ctx: JobContext) -> None:
    await ctx.connect()
    session = AgentSession()  # no stt/llm/tts needed to `say` a recording
    if os.environ.get("LIPSTREAM_IN_PROCESS"):
        engine = await asyncio.to_thread(shared_engine)
        await start_in_process(session, ctx.room, engine, os.environ.get("LIPSTREAM_AVATAR", 0))
    else:
        avatar = AvatarSession(worker_url=os.environ.get("LIPSTREAM_WORKER_URL", "http://127.0.0.1:8089"),
                               avatar=os.environ.get("LIPSTREAM_AVATAR"))
        await avatar.start(session, ctx.room)  # before session.start: the replies go to the avatar
    await session.start(agent=Agent(instructions="Greet the user."), room=ctx.room)
    pcm = await asyncio.to_thread(greeting_pcm)
    while True:
        await session.say(GREETING, audio=frames(pcm))  # the avatar speaks it; interruptions work as usual
        await asyncio.sleep(20)


if __name__ == "__main__":
    cli.run_app(server)
