"""EncodePool: sessions encoded in worker processes give the very bytes an in-process SessionEncoder gives,
in submit order; restarts, dead workers, back-pressure and clean-up behave."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

import lipstream
from lipstream.media import encode_pool
from lipstream.media.encode_pool import EncodePool
from lipstream.media.session_encoder import EncodedPacket, SessionEncoder
from lipstream.media.wire import pack, read_message
from lipstream.fixtures.stream import gradient_i420, nal_types, sine48

RATE = 48_000
PER_FRAME = 1920  # audio samples a frame at 25 fps
SRC = str(Path(lipstream.__file__).resolve().parent.parent)


def leftovers() -> list[str]:
    """Slot files of this process still on disk."""
    return [n for n in os.listdir(encode_pool.slot_dir()) if n.startswith(f"{encode_pool.SHM_PREFIX}{os.getpid()}-")]


def reader_threads(besides: set[threading.Thread]) -> list[str]:
    """Encode workers' reader threads running, but those in `besides`: the threads before the pool was made
    (a render earlier in this process started the process's segment encoders, which it keeps)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("lipstream-encode-reader") and t not in besides]


def assert_pool_gone(pool: EncodePool, pids: list[int], besides: set[threading.Thread]) -> None:
    assert not leftovers()
    assert not reader_threads(besides)
    for pid in pids:  # reaped: no zombie, no live child
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[3] != str(os.getpid())


class Recorder:
    """on_packets / on_error of one session: the calls in order, and a count to wait on."""

    def __init__(self):
        self.calls: list[tuple[int, list[EncodedPacket]]] = []
        self.errors: list[str] = []
        self.changed = threading.Condition()

    def on_packets(self, pts: int, packets: list[EncodedPacket]) -> None:
        with self.changed:
            self.calls.append((pts, packets))
            self.changed.notify_all()

    def on_error(self, sid: int, message: str) -> None:
        with self.changed:
            self.errors.append(message)
            self.changed.notify_all()

    def wait(self, calls: int = 0, errors: int = 0, timeout: float = 10) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: len(self.calls) >= calls and len(self.errors) >= errors, timeout)


# --- the plan of a session: what is submitted, and what an in-process encoder makes of it --------------------

FRAMES = 24
SKIPPED = {7, 8, 15}  # frames the engine skipped: audio only
KEYED = {13}  # a PLI: an IDR on request


def submissions(width: int, height: int):
    for k in range(FRAMES):
        yield k, None if k in SKIPPED else gradient_i420(k, width, height), sine48(k * PER_FRAME, PER_FRAME), k in KEYED


def in_process(width: int, height: int, audio: str) -> list[EncodedPacket]:
    enc = SessionEncoder(width, height, Fraction(25), audio=audio, gop_frames=10)
    out = []
    for k, i420, samples, key in submissions(width, height):
        if key:
            enc.request_keyframe()
        out += enc.encode(i420, k) if i420 is not None else []
        out += enc.encode_audio(samples)
    return out + enc.flush()


SESSIONS = [(160, 96, "opus"), (192, 108, "opus"), (160, 96, "aac"), (192, 108, "none"), (160, 96, "opus")]


@pytest.fixture(scope="module")
def pooled():
    """5 sessions on 2 workers, fed from 2 threads at once; per session: its recorder and final packets."""
    before = set(threading.enumerate())
    pool = EncodePool(2)
    pids = pool.pids
    recorders = [Recorder() for _ in SESSIONS]
    sessions = [pool.open(w, h, Fraction(25), audio=a, gop_frames=10, slots=4, on_packets=r.on_packets,
                          on_error=r.on_error) for (w, h, a), r in zip(SESSIONS, recorders)]
    assert not leftovers(), "slot files are unlinked once both sides have mapped them"
    finals: dict[int, list[EncodedPacket]] = {}
    failed: list[BaseException] = []

    def feed(indices):
        try:
            for i in indices:
                w, h, _ = SESSIONS[i]
                for k, i420, samples, key in submissions(w, h):
                    sessions[i].submit(k, i420, samples, key=key)
            for i in indices:
                finals[i] = sessions[i].close()
        except BaseException as e:  # noqa: BLE001 - shown by the fixture
            failed.append(e)

    threads = [threading.Thread(target=feed, args=(part,)) for part in ([0, 2, 4], [1, 3])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    pool.close()
    assert not failed, failed
    yield sessions, recorders, finals
    assert_pool_gone(pool, pids, before)


def test_sessions_spread_over_workers(pooled):
    sessions, _, _ = pooled
    pids = [s.worker_pid for s in sessions]
    assert sorted(pids.count(p) for p in set(pids)) == [2, 3]


def test_one_call_per_submit_in_order_with_its_video(pooled):
    _, recorders, _ = pooled
    for r in recorders:
        assert not r.errors
        assert [pts for pts, _ in r.calls] == list(range(FRAMES))
        for pts, packets in r.calls:
            video = [p for p in packets if p.kind == "video"]
            if pts in SKIPPED:
                assert not video
            else:
                assert [(p.pts, p.dts) for p in video] == [(pts, pts)]
                assert video[0].time_base == Fraction(1, 25)


def test_packets_byte_identical_to_in_process_encoder(pooled):
    sessions, recorders, finals = pooled
    for i, ((w, h, audio), r) in enumerate(zip(SESSIONS, recorders)):
        got = [p for _, packets in r.calls for p in packets] + finals[i]
        assert got == in_process(w, h, audio), f"session {i} ({w}x{h}, {audio})"
        if audio != "none":
            assert sessions[i].audio_extradata == SessionEncoder(w, h, Fraction(25), audio=audio).audio_extradata
            assert sessions[i].audio_frame_size == {"opus": 960, "aac": 1024}[audio]
        else:
            assert sessions[i].audio_extradata is None and not [p for p in got if p.kind == "audio"]


def test_audio_continuous_over_skipped_frames(pooled):
    _, recorders, finals = pooled
    r, size = recorders[0], 960
    audio = [p for _, packets in r.calls for p in packets if p.kind == "audio"] + finals[0]
    assert [p.pts for p in audio] == [i * size for i in range(len(audio))]
    assert len(audio) * size >= FRAMES * PER_FRAME
    audio_of_skipped = [p for pts, packets in r.calls if pts in SKIPPED for p in packets if p.kind == "audio"]
    assert len(audio_of_skipped) == 2 * len(SKIPPED)  # 1920 samples = 2 Opus frames each


def test_keyframes_by_gop_and_on_request(pooled):
    _, recorders, _ = pooled
    keys = [p.pts for _, packets in recorders[1].calls for p in packets if p.kind == "video" and p.keyframe]
    assert keys == [0, 10, 13, 23]  # the GOP counts on from the requested IDR


def test_video_decodes_close_to_input(pooled):
    _, recorders, _ = pooled
    w, h, _ = SESSIONS[1]
    dec = av.CodecContext.create("h264", "r")
    video = [(pts, p) for pts, packets in recorders[1].calls for p in packets if p.kind == "video"]
    frames = [f for _, p in video for f in dec.decode(av.Packet(p.data))] + list(dec.decode(None))
    assert len(frames) == len(video)
    for (pts, _), frame in zip(video, frames):
        got = frame.to_ndarray(format="yuv420p").astype(np.float64)
        mse = np.mean(np.square(got - gradient_i420(pts, w, h)))
        assert 10 * np.log10(255 ** 2 / max(mse, 1e-9)) > 30


# --- restart ------------------------------------------------------------------------------------------------


def test_session_encoder_restart_drops_state_and_restarts_pts():
    enc = SessionEncoder(64, 64, Fraction(25), audio="aac", gop_frames=25)
    for k in range(6):
        enc.encode(gradient_i420(k, 64, 64), k, sine48(0, 1500))  # 9000 samples: some left in the fifo
    enc.restart(3, 100_000)
    out = enc.encode(gradient_i420(3, 64, 64), 3, sine48(0, 3000))  # lower than before: allowed after a restart
    video = [p for p in out if p.kind == "video"]
    assert [(p.pts, p.dts, p.keyframe) for p in video] == [(3, 3, True)] and 5 in nal_types(video[0].data)
    audio = [p for p in out + enc.flush() if p.kind == "audio"]
    assert [p.pts for p in audio] == [100_000 + i * 1024 for i in range(len(audio))]
    assert len(audio) == 3 + 1  # 3000 samples padded to 3 frames + the priming one (the old 808 would make 5)
    enc.restart(10, 0)
    with pytest.raises(ValueError, match="must rise"):
        enc.encode(gradient_i420(9, 64, 64), 9)


def test_pool_restart_gives_idr_at_given_pts_and_audio_from_audio_pts():
    w, h, audio_pts = 160, 96, 123 * 960
    r = Recorder()
    with EncodePool(1) as pool:
        s = pool.open(w, h, Fraction(25), gop_frames=50, on_packets=r.on_packets, on_error=r.on_error)
        reference = SessionEncoder(w, h, Fraction(25), gop_frames=50)
        expected = []
        for k in range(12):
            s.submit(k, gradient_i420(k, w, h), sine48(k * 1000, 1000))
            expected += reference.encode(gradient_i420(k, w, h), k, sine48(k * 1000, 1000))
        s.restart(6, audio_pts)  # frames 6..11 are thrown away and come again
        reference.restart(6, audio_pts)
        for k in range(6, 10):
            s.submit(k, gradient_i420(k + 50, w, h), sine48(0, 1000))
            expected += reference.encode(gradient_i420(k + 50, w, h), k, sine48(0, 1000))
        final = s.close()
        expected += reference.flush()
    assert not r.errors and [pts for pts, _ in r.calls] == list(range(12)) + list(range(6, 10))
    after = [p for _, packets in r.calls[12:] for p in packets] + final
    video = [p for p in after if p.kind == "video"]
    assert [p.pts for p in video] == [6, 7, 8, 9]
    assert video[0].keyframe and 5 in nal_types(video[0].data) and {7, 8} <= set(nal_types(video[0].data))
    assert not any(p.keyframe for p in video[1:])
    audio = [p for p in after if p.kind == "audio"]
    assert [p.pts for p in audio] == [audio_pts + i * 960 for i in range(len(audio))]
    assert [p for _, packets in r.calls for p in packets] + final == expected  # byte for byte
    dec = av.CodecContext.create("h264", "r")  # a viewer joining at the restart decodes from the IDR
    frames = [f for p in video for f in dec.decode(av.Packet(p.data))] + list(dec.decode(None))
    assert len(frames) == 4
    luma = frames[0].to_ndarray(format="yuv420p")[:h].astype(np.int16)
    assert np.abs(luma - gradient_i420(56, w, h)[:h]).mean() < 3


# --- failures, back-pressure, clean-up ----------------------------------------------------------------------


def test_dead_worker_fails_its_sessions_once_and_the_pool_goes_on():
    a, b = Recorder(), Recorder()
    before = set(threading.enumerate())
    pool = EncodePool(2)
    pids = pool.pids
    try:
        sa = pool.open(64, 64, Fraction(25), slots=2, on_packets=a.on_packets, on_error=a.on_error)
        sb = pool.open(64, 64, Fraction(25), slots=2, on_packets=b.on_packets, on_error=b.on_error)
        assert sa.worker_pid != sb.worker_pid
        sa.submit(0, gradient_i420(0, 64, 64), sine48(0, PER_FRAME))
        a.wait(calls=1)
        os.kill(sa.worker_pid, signal.SIGKILL)
        a.wait(errors=1)
        assert "exited with code -9" in a.errors[0] and f"encode session {sa.sid}" in a.errors[0]
        with pytest.raises(RuntimeError, match=rf"^encode session {sa.sid}: encode worker .* exited") as e:
            sa.submit(1, gradient_i420(1, 64, 64), sine48(0, PER_FRAME))
        assert "\n" not in str(e.value)
        with pytest.raises(RuntimeError):
            sa.submit(1, None, sine48(0, PER_FRAME))
        with pytest.raises(RuntimeError):
            sa.restart(0, 0)
        assert sa.close() == [] and len(a.errors) == 1  # said once
        sb.submit(0, gradient_i420(0, 64, 64), sine48(0, PER_FRAME))  # the other worker's session is untouched
        assert sb.close() and not b.errors and len(b.calls) == 1
        c = Recorder()  # a new session gets a fresh worker in place of the dead one
        sc = pool.open(64, 64, Fraction(25), on_packets=c.on_packets, on_error=c.on_error)
        sc.submit(0, gradient_i420(0, 64, 64), None)
        c.wait(calls=1)
        assert sc.worker_pid not in pids
        pids = pids + pool.pids
        sd = pool.open(64, 64, Fraction(25), on_packets=c.on_packets)  # left open: pool.close ends it quietly
        sd.submit(0, gradient_i420(0, 64, 64), None)
    finally:
        t = time.monotonic()
        pool.close()
        assert time.monotonic() - t < 3
    pool.close()  # idempotent
    assert len(c.errors) == 0 and sd.failure is not None
    with pytest.raises(RuntimeError):
        sd.submit(1, gradient_i420(1, 64, 64), None)
    with pytest.raises(RuntimeError, match="closed"):
        pool.open(64, 64, Fraction(25), on_packets=c.on_packets)
    assert_pool_gone(pool, pids, before)


def test_slots_give_back_pressure(monkeypatch):
    r = Recorder()
    with EncodePool(1) as pool:
        s = pool.open(64, 64, Fraction(25), audio="none", slots=2, on_packets=r.on_packets, on_error=r.on_error)
        pid = s.worker_pid
        os.kill(pid, signal.SIGSTOP)  # a worker that does not answer: no slot comes back
        try:
            s.submit(0, gradient_i420(0, 64, 64), None)
            s.submit(1, gradient_i420(1, 64, 64), None)
            third = threading.Thread(target=s.submit, args=(2, gradient_i420(2, 64, 64), None))
            third.start()
            third.join(0.3)
            assert third.is_alive(), "the third frame waits for a slot"
        finally:
            os.kill(pid, signal.SIGCONT)
        third.join(5)
        assert not third.is_alive()
        r.wait(calls=3)
        monkeypatch.setattr(encode_pool, "SLOT_WAIT_S", 0.2)
        os.kill(pid, signal.SIGSTOP)
        try:
            s.submit(3, gradient_i420(3, 64, 64), None)
            s.submit(4, gradient_i420(4, 64, 64), None)
            with pytest.raises(RuntimeError, match=rf"encode session {s.sid}: no free frame slot in 0.2 s"):
                s.submit(5, gradient_i420(5, 64, 64), None)
        finally:
            os.kill(pid, signal.SIGCONT)
        s.submit(5, gradient_i420(5, 64, 64), None)
        s.close()
    assert [pts for pts, _ in r.calls] == [0, 1, 2, 3, 4, 5] and not r.errors
    assert [p.pts for _, packets in r.calls for p in packets] == [0, 1, 2, 3, 4, 5]


def test_bad_input_and_failing_frames():
    r = Recorder()
    with EncodePool(1) as pool:
        with pytest.raises(ValueError, match="even"):
            pool.open(63, 64, Fraction(25), on_packets=r.on_packets)
        with pytest.raises(ValueError, match="audio"):
            pool.open(64, 64, Fraction(25), audio="mp3", on_packets=r.on_packets)
        with pytest.raises(RuntimeError, match="preset"):  # SessionEncoder's own error, from the worker
            pool.open(64, 64, Fraction(25), x264_preset="nonsense", on_packets=r.on_packets)
        s = pool.open(64, 64, Fraction(25), audio="aac", on_packets=r.on_packets, on_error=r.on_error)
        with pytest.raises(ValueError, match=r"expected uint8 I420 of shape \(96, 64\), got float32 \(96, 64\)"):
            s.submit(0, np.zeros((96, 64), np.float32), None)
        with pytest.raises(ValueError, match=r"shape \(96, 64\)"):
            s.submit(0, np.zeros((64, 64), np.uint8), None)
        s.submit(0, gradient_i420(0, 64, 64), sine48(0, PER_FRAME))
        s.submit(0, gradient_i420(0, 64, 64), sine48(0, PER_FRAME))  # pts must rise: the video fails, the audio goes
        s.submit(1, gradient_i420(1, 64, 64), np.full(100, np.nan, np.float32))  # bad audio: the video goes
        s.submit(2, gradient_i420(2, 64, 64), sine48(0, PER_FRAME))
        assert s.close()
    assert [pts for pts, _ in r.calls] == [0, 0, 1, 2]
    assert [[p.kind for p in packets] for _, packets in r.calls][1:3] == [["audio", "audio"], ["video"]]
    assert len(r.errors) == 2 and "video: ValueError: video pts must rise" in r.errors[0]
    assert "audio: ValueError: audio holds NaN" in r.errors[1]
    assert not leftovers()


def test_a_raising_callback_does_not_stop_the_reader():
    calls = []

    def on_packets(pts, packets):
        calls.append(pts)
        if pts == 0:
            raise RuntimeError("consumer bug")

    with EncodePool(1) as pool:
        s = pool.open(64, 64, Fraction(25), audio="none", on_packets=on_packets)
        for k in range(3):
            s.submit(k, gradient_i420(k, 64, 64), None)
        s.close()
    assert calls == [0, 1, 2]


# --- the worker on its own: the wire format, and no torch ---------------------------------------------------


def test_worker_speaks_the_protocol_without_torch(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p))
    worker = subprocess.Popen([sys.executable, "-m", "lipstream.media.encode_worker"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=env)

    def ask(header: dict, payload: bytes = b"", reply: bool = True):
        worker.stdin.write(pack(header, payload))
        worker.stdin.flush()
        return read_message(worker.stdout) if reply else None

    try:
        slots = tmp_path / "slots"
        slots.write_bytes(gradient_i420(0, 64, 64).tobytes() + gradient_i420(1, 64, 64).tobytes())
        h, extradata = ask({"type": "open", "sid": 7, "width": 64, "height": 64, "fps": [25, 1], "audio": "opus",
                            "x264_preset": "ultrafast", "crf": 23, "gop_frames": 10, "matrix": "bt601",
                            "path": str(slots), "slots": 2})
        assert h == {"type": "opened", "sid": 7, "audio_frame_size": 960} and bytes(extradata).startswith(b"OpusHead")
        h, data = ask({"type": "frame", "sid": 7, "pts": 0, "slot": 1, "key": False}, sine48(0, 960).tobytes())
        assert h["type"] == "packets" and (h["pts"], h["slot"]) == (0, 1)
        assert [p[0] for p in h["packets"]] == ["v", "a"] and sum(p[4] for p in h["packets"]) == len(data)
        assert ask({"type": "restart", "sid": 7, "video_pts": 0, "audio_pts": 0}, reply=False) is None
        h, _ = ask({"type": "frame", "sid": 8, "pts": 0, "slot": 1, "key": False})
        assert h == {"type": "error", "sid": 8, "request": "frame", "message": "LookupError: unknown session 8",
                     "pts": 0, "slot": 1}
        h, _ = ask({"type": "bogus", "sid": 7})
        assert h["type"] == "error" and "bogus" in h["message"]
        h, _ = ask({"type": "frame", "sid": 7, "pts": 0, "slot": 0, "key": True})  # pts 0 again: fine after restart
        assert h["type"] == "packets" and h["packets"][0][3] is True and "error" not in h
        h, _ = ask({"type": "ping"})
        assert h == {"type": "pong", "pid": worker.pid, "torch": False}
        h, data = ask({"type": "close", "sid": 7})
        assert h["type"] == "closed" and sum(p[4] for p in h["packets"]) == len(data)
        worker.stdin.close()
        assert worker.wait(10) == 0 and worker.stdout.read() == b""
    finally:
        worker.kill()
        worker.wait()


def test_media_imports_no_torch():
    """Every module of lipstream.media runs in worker processes (encode workers, WebRTC workers, segment
    encoders) that must start in a blink: none of them may import torch, nor anything that does."""
    import pkgutil

    import lipstream.media

    modules = [f"lipstream.media.{m.name}" for m in pkgutil.iter_modules(lipstream.media.__path__)]
    assert {"lipstream.media.encode_pool", "lipstream.media.encode_worker", "lipstream.media.wire"} <= set(modules)
    code = f"import importlib, json, sys; [importlib.import_module(m) for m in {modules!r}]; " \
           "import lipstream.serve.rtc_worker; print(json.dumps('torch' in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                         env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p))).stdout
    assert json.loads(out) is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pipe capacities are Linux's (F_SETPIPE_SZ)")
def test_a_workers_reply_pipe_holds_a_megabyte():
    """A worker blocks in its reply's write until the parent drains all but a pipe's worth: 1 MB, not 64 KB."""
    import fcntl

    from lipstream.media.processes import REPLY_PIPE_BYTES, start_worker

    proc = start_worker("lipstream.media.encode_worker")
    try:
        assert fcntl.fcntl(proc.stdout.fileno(), 1032) >= REPLY_PIPE_BYTES  # F_GETPIPE_SZ
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()
