"""`lipstream bench` smoke run on the CPU: tiny models, short scenarios, real files checked."""

from __future__ import annotations

import json

import av
import pytest

from lipstream.bench.run import run


@pytest.mark.slow
def test_bench_smoke(tiny_models, tmp_path):
    report = run(tiny_models, tmp_path, width=480, height=270, scale=0.05, modes=("legacy", "fast", "ablation"))
    rows = {(r["scenario"], r["mode"]): r for r in report["rows"]}
    ablation = ["fast -cuda graphs", "fast -gpu blending", "fast -gathered windows", "fast -in-process encode",
                "fast -yuv path", "fast -parallel encode", "fast -upsample fusion", "fast -mask-rows decode"]
    assert set(rows) == {(s, m) for s in "AB" for m in ["legacy", "fast", *ablation]}
    for (scenario, mode), row in rows.items():  # each row's rate is its own frames over its own wall time
        assert row["frames"] == rows[(scenario, "fast")]["frames"], (scenario, mode)
        assert row["fps"] == pytest.approx(row["frames"] / row["wall_s"]) and 0 < row["wall_s"] < 600, (scenario, mode)
    for scenario, frames in (("A", 15), ("B", 39)):  # 3 x 0.2 s at 25 fps; 1.29 s at 30 fps
        legacy, fast = rows[(scenario, "legacy")], rows[(scenario, "fast")]
        assert legacy["frames"] == fast["frames"] == frames
        assert legacy["disk_bytes_written"] > 0 and fast["disk_bytes_written"] == 0  # PNGs + a temp video
        assert rows[(scenario, "fast -in-process encode")]["disk_bytes_written"] > 0
        assert rows[(scenario, "fast -yuv path")]["psnr_db"] > 30
        assert abs(rows[(scenario, "fast -upsample fusion")]["psnr_db"] - fast["psnr_db"]) < 0.5  # exact maths
        assert rows[(scenario, "fast -mask-rows decode")]["psnr_db"] > 30
        # the speed-up is the legacy row's wall time over the row's own, for every mode
        assert legacy["speedup"] == 1.0 and all(rows[(scenario, m)]["speedup"] == pytest.approx(
            legacy["wall_s"] / rows[(scenario, m)]["wall_s"]) for m in ["fast", *ablation])
        assert fast["psnr_db"] > 30 and legacy["psnr_db"] > 25  # random-noise faces at crf 18 vs lossless
        for mode in ("legacy", "fast"):
            with av.open(str(tmp_path / f"{scenario}-{mode}.mp4")) as c:
                assert sum(1 for _ in c.decode(video=0)) == frames
                assert c.streams.audio
    assert json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert "| A | legacy |" in (tmp_path / "bench.md").read_text()
    assert not (tmp_path / "work").exists()
    for picture in ("bench_fps.png", "freeze_A.png", "freeze_B.png"):
        assert (tmp_path / picture).stat().st_size > 1000
        assert f"({picture})" in (tmp_path / "bench.md").read_text()


@pytest.mark.slow
def test_bench_oneshot_rows_run_the_command_a_user_types(tiny_models, tmp_path):
    """Each one-shot row is a fresh `lipstream broadcast` process: same frames as the scenario, its own wall clock."""
    report = run(tiny_models, tmp_path, width=480, height=270, scale=0.05, modes=("oneshot",))
    rows = {(r["scenario"], r["mode"]): r for r in report["rows"]}
    assert set(rows) == {(s, m) for s in "AB" for m in ("one-shot, nothing cached", "one-shot, warm")}
    for (scenario, _), row in rows.items():
        assert row["frames"] == {"A": 15, "B": 39}[scenario]
        assert 0 < row["first_frame_s"] < row["wall_s"]  # from the process start, imports included
        assert row["engine"].startswith("uncompiled engine: tiny random networks on cpu")
        assert "start-up and render" in row["timings_table"]
        assert row["psnr_db"] > 30
    assert "One-shot rows" in (tmp_path / "bench.md").read_text()


def test_without_matplotlib_the_charts_are_left_out_with_a_note(tmp_path, monkeypatch):
    """matplotlib is not in the core install: the reports are written without their charts, and say so."""
    import sys

    from lipstream.bench import figures, live

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    report = {"rows": [{"scenario": "A", "mode": "fast", "fps": 10.0}], "device": "cpu", "size": "480x270"}
    assert figures.fps_chart(report, tmp_path / "bench_fps.png") is None
    assert live.chart({"rows": []}, tmp_path / "live_bench.png") is False
    assert list(tmp_path.iterdir()) == []
    assert "pip install matplotlib" in figures.NO_CHART
