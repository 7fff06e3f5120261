"""The MP4 writer: one encoder or several segment encoders, every preset, decoded and checked.

CI has 2 cores, where the renderer picks one encoder; big machines pick several. These tests
force the segment path so it runs here too, with presets that use B-frames (veryfast, medium),
whose segment joins need the decode timestamps renumbered.
"""

from __future__ import annotations

import os
import time
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from lipstream.media.mp4 import MP4Writer, dts_delay
from lipstream.media.rates import AUDIO_RATE

W, H, FPS, FRAMES = 192, 128, Fraction(25), 75


def moving_frames(n: int, seed: int = 0) -> list[np.ndarray]:
    """I420 frames of a drifting pattern: smooth motion, so x264 really places B-frames."""
    rng = np.random.default_rng(seed)
    texture = rng.integers(0, 256, (H * 2, W * 2), dtype=np.uint8)
    yy, xx = np.mgrid[0:H, 0:W]
    frames = []
    for i in range(n):
        y = texture[i // 2:i // 2 + H, i:i + W] // 2 + ((xx + 3 * i) % 64).astype(np.uint8)
        u = np.full((H // 2, W // 2), 100 + i % 50, np.uint8)
        v = np.full((H // 2, W // 2), 150 - i % 40, np.uint8)
        frames.append(np.concatenate([y, u.reshape(H // 4, W), v.reshape(H // 4, W)]))
    return frames


def write(path: Path, frames: list[np.ndarray], preset: str, encoders: int, processes: bool = False,
          crf: int = 18) -> None:
    audio = np.sin(np.arange(int(len(frames) / FPS * AUDIO_RATE)) * 0.05).astype(np.float32) * 0.3
    with MP4Writer(path, W, H, FPS, audio, crf=crf, x264_preset=preset, encoders=encoders, processes=processes,
                   total_frames=len(frames)) as writer:
        for f in frames:
            writer.write(f)


def probe(path: Path) -> dict:
    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        packets = [p for p in c.demux(v) if p.size]
        info = {"dts": [p.dts for p in packets], "pts": [p.pts for p in packets],
                "b_frames": sum(p.pts < max(q.pts for q in packets[:k + 1]) for k, p in enumerate(packets)),
                "audio_s": float(a.duration * a.time_base)}
    with av.open(str(path)) as c:
        decoded = list(c.decode(video=0))
        info["frames"] = [f.to_ndarray() for f in decoded]
        info["video_start"] = float(decoded[0].time)
        info["video_s"] = float(decoded[-1].time) + float(1 / FPS)
    with av.open(str(path)) as c:
        info["audio_start"] = float(next(c.decode(audio=0)).time)
    return info


@pytest.mark.parametrize("preset", ["ultrafast", "veryfast", "medium"])
@pytest.mark.parametrize("encoders", [1, 2, 3])
def test_every_preset_joins_segments_into_one_playable_track(tmp_path, preset, encoders):
    frames = moving_frames(FRAMES)
    out = tmp_path / "out.mp4"
    write(out, frames, preset, encoders)
    info = probe(out)
    assert len(info["frames"]) == FRAMES
    # Every frame in its place (lossy, and crf 0 would turn B-frames off): nearest to its own source.
    for i, got in enumerate(info["frames"]):
        errors = [np.abs(got.astype(np.int16) - frames[j]).mean() for j in range(max(0, i - 2), min(FRAMES, i + 3))]
        assert int(np.argmin(errors)) == min(i, 2) and min(errors) < 3, f"frame {i}: {errors}"
    assert all(b > a for a, b in zip(info["dts"], info["dts"][1:])), "DTS must rise strictly"
    assert all(d <= p for d, p in zip(info["dts"], info["pts"]))
    if preset != "ultrafast":
        assert info["b_frames"] > 0  # the case that broke: reordered frames across segment joins
    assert info["video_start"] == 0 and abs(info["audio_start"]) < 1e-3
    assert abs(info["audio_s"] - FRAMES / FPS) < 0.03 and abs(info["video_s"] - FRAMES / FPS) < 1e-6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.mp4"]


def test_segment_processes_with_b_frames(tmp_path):
    frames = moving_frames(40, seed=1)
    write(tmp_path / "p.mp4", frames, "veryfast", encoders=2, processes=True, crf=18)
    info = probe(tmp_path / "p.mp4")
    assert len(info["frames"]) == 40 and info["b_frames"] > 0
    assert all(b > a for a, b in zip(info["dts"], info["dts"][1:]))


def test_dts_delay_follows_the_settings():
    assert dts_delay({"preset": "ultrafast"}) == 0
    assert dts_delay({"preset": "veryfast"}) == dts_delay({"preset": "medium"}) == 2  # B-pyramid
    assert dts_delay({"preset": "medium", "tune": "zerolatency"}) == 0


def test_an_aborted_segment_write_leaves_nothing(tmp_path):
    """An exception (Ctrl-C) mid-render: queued segments dropped, running ones not waited for, no file."""
    frames = moving_frames(40, seed=2)
    audio = np.zeros(int(40 / FPS * AUDIO_RATE), np.float32)
    with pytest.raises(KeyboardInterrupt):
        with MP4Writer(tmp_path / "x.mp4", W, H, FPS, audio, x264_preset="medium", encoders=2, total_frames=80) as w:
            for f in frames:
                w.write(f)
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def _arena_files() -> list[str]:
    from lipstream.media.encode_pool import slot_dir

    return sorted(f for f in os.listdir(slot_dir()) if f.startswith(f"lipstream-encode-{os.getpid()}-arena"))


def test_segment_processes_match_threads_and_leave_no_shared_memory(tmp_path):
    """The thread pool's track (frame order, timestamps, pictures), frames through the arena, and no
    shared-memory file left once the writer closes (nor while it writes: unlinked once mapped).

    Not bit for bit: this libx264 reads memory it never wrote (MALLOC_PERTURB_ changes its bytes, even
    alone on one thread), so two encodes of the same frames differ in a few decisions."""
    frames = moving_frames(FRAMES, seed=3)
    write(tmp_path / "t.mp4", frames, "veryfast", encoders=3)
    write(tmp_path / "p.mp4", frames, "veryfast", encoders=3, processes=True)
    t, p = probe(tmp_path / "t.mp4"), probe(tmp_path / "p.mp4")
    assert len(p["frames"]) == FRAMES and p["dts"] == t["dts"] and p["pts"] == t["pts"]
    for i, (a, b) in enumerate(zip(t["frames"], p["frames"])):
        to_source = np.abs(b.astype(np.int16) - frames[i]).mean()
        to_threads = np.abs(b.astype(np.int16) - a).mean()
        assert to_source < 3.5 and to_threads < 1.5, f"frame {i}: {to_source:.2f} off source, {to_threads:.2f} off threads"
    assert _arena_files() == []


@pytest.mark.parametrize("kill", ["one", "every"])
def test_a_segment_worker_killed_mid_write_costs_no_frame(tmp_path, caplog, kill):
    """SIGKILL of a segment encoder with segments in flight: they are encoded again (on a live worker of the
    writer's, or in this process once none is left) and the file comes out whole; no shared memory is left,
    and the next writer gets fresh workers in place of the dead."""
    import signal

    from lipstream.media.segment_pool import segment_pool

    frames = moving_frames(40, seed=4)
    audio = np.zeros(int(40 / FPS * AUDIO_RATE), np.float32)
    pool = segment_pool(2)
    before = [w.pid for w in pool.workers]
    killed = []
    with caplog.at_level("WARNING", logger="lipstream.media.segment_pool"):
        with MP4Writer(tmp_path / "x.mp4", W, H, FPS, audio, x264_preset="medium", encoders=2, processes=True,
                       total_frames=40) as w:
            for i, f in enumerate(frames):
                w.write(f)
                if not killed and any(worker.sessions for worker in pool.workers):  # a segment in flight
                    busy = [worker for worker in pool.workers if worker.sessions]
                    killed = busy[:1] if kill == "one" else list(pool.workers)
                    for worker in killed:
                        os.kill(worker.pid, signal.SIGKILL)
    assert killed
    retried = [r.getMessage() for r in caplog.records if "exited with code -9" in r.getMessage()]
    assert retried and all("\n" not in m for m in retried), caplog.text
    assert ("sent again" in retried[0]) if kill == "one" else ("encoded in this process" in caplog.text)
    got = probe(tmp_path / "x.mp4")["frames"]
    assert len(got) == 40 and max(np.abs(g.astype(np.int16) - f).mean() for g, f in zip(got, frames)) < 3.5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.mp4"] and _arena_files() == []
    for worker in killed:  # the next writer, once they are gone, gets fresh workers in their place
        worker.proc.wait(timeout=30)
    write(tmp_path / "again.mp4", frames, "ultrafast", encoders=2, processes=True)
    assert len(probe(tmp_path / "again.mp4")["frames"]) == 40
    now = {w.pid for w in pool.workers}
    assert len(now) == 2 and not now & {w.pid for w in killed} and set(before) - {w.pid for w in killed} <= now


def test_an_aborted_process_write_leaves_nothing(tmp_path):
    frames = moving_frames(40, seed=5)
    audio = np.zeros(int(40 / FPS * AUDIO_RATE), np.float32)
    with pytest.raises(KeyboardInterrupt):
        with MP4Writer(tmp_path / "x.mp4", W, H, FPS, audio, x264_preset="medium", encoders=2, processes=True,
                       total_frames=80) as w:
            for f in frames:
                w.write(f)
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == [] and _arena_files() == []


def test_a_prepared_arena_is_taken_by_the_writer_and_kept_for_the_next(tmp_path):
    """The CLI makes the arena before the frames exist (its pages faulted in on a thread); the writer takes it,
    a finished writer leaves it for the next of that size, whose output is as good; an aborted one does not."""
    from lipstream.media.mp4 import arena_slots
    from lipstream.media.segment_pool import segment_pool

    frames = moving_frames(40, seed=6)
    pool = segment_pool(2)
    pool.prepare(W, H, arena_slots(2))
    deadline = time.monotonic() + 30
    while not pool._idle and time.monotonic() < deadline:
        time.sleep(0.01)
    (prepared,) = pool._idle
    assert prepared.prefaulted.wait(30) and prepared.shape == (W, H, arena_slots(2))
    write(tmp_path / "a.mp4", frames, "ultrafast", encoders=2, processes=True)
    assert pool._idle == [prepared]  # taken, then given back
    write(tmp_path / "b.mp4", frames, "ultrafast", encoders=2, processes=True)
    assert pool._idle == [prepared]
    for name in ("a.mp4", "b.mp4"):
        got = probe(tmp_path / name)["frames"]
        assert len(got) == 40 and max(np.abs(g.astype(np.int16) - f).mean() for g, f in zip(got, frames)) < 3.5
    audio = np.zeros(int(40 / FPS * AUDIO_RATE), np.float32)
    with pytest.raises(KeyboardInterrupt):
        with MP4Writer(tmp_path / "x.mp4", W, H, FPS, audio, x264_preset="ultrafast", encoders=2, processes=True,
                       total_frames=40) as w:
            w.write(frames[0])
            raise KeyboardInterrupt
    assert pool._idle == [] and prepared.frames is None  # closed, not kept
    assert _arena_files() == [] and sorted(p.name for p in tmp_path.iterdir()) == ["a.mp4", "b.mp4"]


def test_the_arena_kept_is_the_last_released_so_a_prepare_for_a_new_size_is_not_thrown_away():
    """A process that rendered one frame size (a server's jobs, the tests) and prepares the arena of another for
    its next render keeps the new one: the idle arena of the old size is closed instead."""
    from lipstream.media.mp4 import arena_slots
    from lipstream.media.segment_pool import segment_pool

    pool = segment_pool(2)
    for width in (W, W + 64, W):
        pool.prepare(width, H, arena_slots(2))
        taken = pool.arena(width, H, arena_slots(2))  # waits for the prepare(), and takes what it made
        assert taken.prefaulted.wait(30) and taken.shape == (width, H, arena_slots(2))
        taken.release()
        assert pool._idle == [taken]
    deadline = time.monotonic() + 30
    while _arena_files() and time.monotonic() < deadline:  # each file goes once every worker has mapped it
        time.sleep(0.01)
    assert _arena_files() == []
