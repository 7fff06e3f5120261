"""A worker process started from an event loop (media/processes.py's start_worker_async, the WebRTC workers')
while another thread holds a PyAV reformatter in its thread-local, as PyAV 19's VideoFrame.reformat keeps
one: under uvloop (uvicorn's loop where it is installed, Ray's in every actor) asyncio's own subprocess
start hung there on Python 3.12 (the child freed that reformatter before its exec and waited forever on
its slice threads' condition variable; the loop waited for the exec). Run in a process of its own with a
deadline, so a hang fails the test instead of holding the suite; both loops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

SCRIPT = r"""
import asyncio, sys, threading, time
import av, numpy as np
from lipstream.media.processes import start_worker_async

def holder(ready, stop):
    frame = av.VideoFrame.from_ndarray(np.zeros((1080, 1920, 3), np.uint8), format="rgb24")
    for _ in range(3):
        frame.reformat(width=1280, height=720, format="yuv420p")  # its reformatter in this thread's local
    ready.set()
    stop.wait()

async def main():
    ready, stop = threading.Event(), threading.Event()
    threading.Thread(target=holder, args=(ready, stop), daemon=True).start()
    ready.wait()
    worker = await start_worker_async("lipstream.serve.rtc_worker")
    worker.stdin.close()  # EOF: the worker ends
    code = await asyncio.wait_for(worker.wait(), 60)
    stop.set()
    print("worker", worker.pid, "exit", code)

if sys.argv[1] == "uvloop":
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_worker_starts_from_an_event_loop_beside_a_thread_holding_a_reformatter(loop):
    if loop == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop is not installed")
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, loop], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the stuck child with it
        proc.communicate()
        pytest.fail(f"starting a worker under {loop} hung")
    assert proc.returncode == 0 and "exit 0" in out, out + err[-2000:]
