"""What the show's layers cost a 1080p render: Compositor.apply over batches of I420 frames on the device.

A render at ~600 fps has 1.67 ms a frame; issue 29 allows the layers 5% of that (83 us a frame). This
times apply alone (GPU time by CUDA events, and the producer thread's CPU time to queue it), with every
layer on (lower third, a 1080p video pip decoded as it goes, logo, ticker), then a full-frame cutaway
(still, then video), and the pip's decoder alone (frames a second it delivers). Between batches it
sleeps for the render's own time (--render-fps), as the producer thread renders: the decoders work then. It also checks that the
device's output matches the CPU's. Prints one JSON object.
  PYTHONPATH=src python3 benchmarks/show_layers.py [--batch 32] [--batches 40]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import av
import numpy as np
import torch
from PIL import Image

from lipstream.show.build import build_compositor
from lipstream.show.sources import VideoSource
from lipstream.show.spec import Logo, LowerThird, Picture, SceneLayers, Show, Span, Ticker

W, H, FPS = 1920, 1080, 25


def footage(path: Path, seconds: float = 4.0, size: tuple[int, int] = (1920, 1080)) -> Path:
    """A moving 1080p H.264 clip (a gradient that slides), like camera footage for the pip."""
    yy, xx = np.mgrid[0:size[1], 0:size[0]]
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=FPS, options={"crf": "20", "preset": "ultrafast"})
        s.width, s.height, s.pix_fmt = size[0], size[1], "yuv420p"
        for k in range(int(seconds * FPS)):
            rgb = np.stack([(xx + 8 * k) % 256, (yy + 4 * k) % 256, (xx + yy) // 12 % 256], -1).astype(np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                c.mux(p)
        for p in s.encode(None):
            c.mux(p)
    return path


def frames(n: int, device: torch.device) -> torch.Tensor:
    yy, xx = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    f = torch.empty((n, H * 3 // 2, W), dtype=torch.uint8)
    f[:, :H] = ((xx + yy) // 9 % 200 + 30).to(torch.uint8)
    f[:, H:] = 128
    return f.to(device)


def time_apply(show: Show, device: torch.device, batch: int, batches: int, durations: list[float],
               render_fps: float) -> dict:
    comp = build_compositor(show, (W, H), FPS, [0.0], durations, "bt709", device)
    src = frames(batch, device)
    work = src.clone()
    cpu_s, n = 0.0, 0
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gpu_ms = 0.0
    with comp:
        for b in range(batches + 3):  # 3 warm-up batches
            ts = [(b * batch + i) / FPS for i in range(batch)]
            work.copy_(src)
            time.sleep(batch / render_fps)  # the render's own time for the batch: the decoders run meanwhile
            sync()
            t = time.perf_counter()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            comp.apply(work, [(0, x, x) for x in ts])
            c = time.perf_counter() - t
            if cuda:
                end.record()
            sync()
            if b >= 3:
                cpu_s += c
                gpu_ms += start.elapsed_time(end) if cuda else 1000 * (time.perf_counter() - t)
                n += batch
    return {"frames": n, "gpu_us_per_frame": round(1000 * gpu_ms / n, 2),
            "cpu_us_per_frame": round(1e6 * cpu_s / n, 2),
            "share_of_600fps_frame_pct": round(100 * max(gpu_ms / n / 1000, cpu_s / n) / (1 / 600), 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--render-fps", type=float, default=600.0, help="the render's rate, untimed between batches")
    a = ap.parse_args()
    device = torch.device(a.device)
    out: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "batch": a.batch,
                 "size": [W, H]}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t = time.perf_counter()
        clip = footage(tmp / "footage.mp4")
        out["footage_write_s"] = round(time.perf_counter() - t, 1)
        logo = tmp / "logo.png"
        Image.new("RGBA", (240, 120), (255, 200, 0, 200)).save(logo)
        chart = tmp / "chart.png"
        Image.new("RGB", (1600, 1000), (30, 90, 200)).save(chart)
        seconds = (a.batches + 3) * a.batch / FPS + 1
        overlays = dict(logo=Logo(logo, corner="top-right", margin=32),
                        ticker=Ticker("Breaking: markets closed higher today, led by technology shares. " * 3, 120))
        lt = LowerThird("Anna Berg", "Berlin", Span(0.0, None, fade=0.0))
        pip = Picture(clip, (1180, 120, 1820, 480), Span(0.0, None, fade=0.0), loop=True)
        runs = {
            "overlays_only": Show(scenes=[SceneLayers()], **overlays),
            "all_layers_video_pip": Show(scenes=[SceneLayers(lower_third=lt, pip=pip)], **overlays),
            "cutaway_still": Show(scenes=[SceneLayers(cutaway=Picture(chart, None, Span(0.0, None, 0.0)))]),
            "cutaway_video": Show(scenes=[SceneLayers(cutaway=Picture(clip, None, Span(0.0, None, 0.0), loop=True))]),
        }
        for name, show in runs.items():
            out[name] = time_apply(show, device, a.batch, a.batches, [seconds], a.render_fps)
        src = VideoSource(clip, (640, 360), loop=True)
        t = time.perf_counter()
        for k in range(300):
            src.frame_at(k / FPS)
        out["pip_decoder_fps_1080p_to_360p"] = round(300 / (time.perf_counter() - t), 1)
        src.close()
        # the device's pixels are the CPU's (float order aside: at most 1 code value apart)
        show = runs["all_layers_video_pip"]
        times = [(0, 1.0 + i / FPS, 1.0 + i / FPS) for i in range(8)]
        results = []
        for dev in ("cpu", a.device):
            with build_compositor(show, (W, H), FPS, [0.0], [seconds], "bt709", dev) as comp:
                results.append(comp.apply(frames(8, torch.device(dev)), times).cpu())
        d = (results[0].int() - results[1].int()).abs()
        out["cpu_vs_cuda"] = {"max_abs": int(d.max()), "pixels_differing": int((d > 0).sum())}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
