"""A faithful re-creation of the reference implementation's approach, as the baseline.

What MuseTalk's realtime_inference does, step by step: audio windows sliced in a Python loop
and concatenated; eager fp16 UNet + VAE decode in batches of 20; each face converted to uint8
BGR, resized with OpenCV and pasted into the full RGB frame with PIL using the blend mask; a PNG
written per frame; the PNGs encoded to a video; then a second encode to add the audio. Same
weights, same avatar cache, same schedule as the fast path: only the way of working differs.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import av
import cv2
import numpy as np
import torch
from PIL import Image

from lipstream.avatar import load_avatar, ping_pong
from lipstream.media.pixels import yuv_to_rgb_affine
from lipstream.audio.features import whisper_features
from lipstream.audio.windows import audio_windows_loop
from lipstream.files import atomic_path
from lipstream.media.rates import AUDIO_RATE
from lipstream.models import MuseTalk
from lipstream.models.config import VAE_SCALING_FACTOR
from lipstream.avatar.folders import resolve_avatar
from lipstream.render.program import load_speech
from lipstream.render.script import Program

BATCH = 20  # upstream's default batch size


def _rgb(i420: np.ndarray, height: int, width: int, matrix: str) -> np.ndarray:
    y = i420[:height]
    u = cv2.resize(i420[height:].reshape(-1)[: height * width // 4].reshape(height // 2, width // 2), (width, height),
                   interpolation=cv2.INTER_NEAREST)
    v = cv2.resize(i420[height:].reshape(-1)[height * width // 4:].reshape(height // 2, width // 2), (width, height),
                   interpolation=cv2.INTER_NEAREST)
    return cv2.transform(cv2.merge([y, u, v]), yuv_to_rgb_affine(matrix))


class PNGSequenceWriter:
    """The reference implementation's output stage, behind MP4Writer's interface.

    A PNG per frame in a temporary folder, then those PNGs encoded into a video, then a second
    encode that adds the audio. The legacy mode uses it, and so does the "in-process encode off"
    ablation of the fast path. `disk_bytes_written` counts what went to disk on the way.
    """

    def __init__(self, dest: str | Path, width: int, height: int, fps: Fraction, audio: np.ndarray, *, crf: int = 18,
                 x264_preset: str = "veryfast", matrix: str = "bt601", **_ignored):
        self.dest, self.width, self.height, self.fps = Path(dest), width, height, Fraction(fps)
        self.audio, self.matrix = audio, matrix
        self.options = {"crf": str(crf), "preset": x264_preset}
        self.frames = 0
        self.disk_bytes_written = 0
        self.first_packet_at: float | None = None
        self.first_submit_at: float | None = None  # no encoder runs until every PNG is written
        self.work = Path(tempfile.mkdtemp(prefix="lipstream-png-"))

    def __enter__(self) -> "PNGSequenceWriter":
        return self

    def write(self, planes: np.ndarray) -> None:
        self.write_rgb(_rgb(planes, self.height, self.width, self.matrix))

    def write_rgb(self, rgb: np.ndarray) -> None:
        png = self.work / f"{self.frames:08d}.png"
        cv2.imwrite(str(png), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
        self.disk_bytes_written += png.stat().st_size
        self.frames += 1

    def poll(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._encode()
        finally:
            shutil.rmtree(self.work, ignore_errors=True)

    def _encode(self) -> None:
        silent = self.work / "video.mp4"  # first encode: PNG sequence -> video without audio
        with av.open(str(silent), "w") as c:
            stream = c.add_stream("libx264", rate=self.fps, options=self.options)
            stream.width, stream.height, stream.pix_fmt = self.width, self.height, "yuv420p"
            for i in range(self.frames):
                bgr = cv2.imread(str(self.work / f"{i:08d}.png"))
                for p in stream.encode(av.VideoFrame.from_ndarray(bgr, format="bgr24")):
                    c.mux(p)
            for p in stream.encode(None):
                c.mux(p)
        self.disk_bytes_written += silent.stat().st_size
        with atomic_path(self.dest) as tmp, av.open(str(silent)) as src, \
                av.open(str(tmp), "w", format="mp4") as dst:  # second encode: video again, plus the audio
            v = dst.add_stream("libx264", rate=self.fps, options=self.options)
            v.width, v.height, v.pix_fmt = self.width, self.height, "yuv420p"
            a = dst.add_stream("aac", rate=AUDIO_RATE, layout="mono")
            for i, frame in enumerate(src.decode(video=0)):
                frame.pts, frame.time_base = i, 1 / self.fps
                for p in v.encode(frame):
                    dst.mux(p)
                    self.first_packet_at = self.first_packet_at or time.perf_counter()
            for p in v.encode(None):
                dst.mux(p)
            for i in range(0, self.audio.size, 1024):
                af = av.AudioFrame.from_ndarray(np.ascontiguousarray(self.audio[None, i:i + 1024], np.float32),
                                                format="fltp", layout="mono")
                af.sample_rate, af.pts = AUDIO_RATE, i
                for p in a.encode(af):
                    dst.mux(p)
            for p in a.encode(None):
                dst.mux(p)


def render_legacy(program: Program, output: Path, models: MuseTalk, *, fps: Fraction | None = None) -> dict:
    """Render `program` the legacy way; returns wall time, fps and the bytes written to disk on the way."""
    t0 = time.perf_counter()
    avatars = {}
    for scene in program.scenes:
        for shot in scene.shots:
            avatars.setdefault(shot.avatar, load_avatar(resolve_avatar(shot.avatar, program.avatars_dir), "cpu",
                                                        vae_fingerprint=models.fingerprints.get("vae")))
    first = avatars[program.scenes[0].shots[0].avatar]
    width, height = first.size
    fps = Fraction(fps or program.fps or first.fps)
    speech = [load_speech(scene.audio, models.device) for scene in program.scenes]
    writer = PNGSequenceWriter(output, width, height, fps, np.concatenate([s48 for _, s48 in speech]))
    with writer:
        for scene, (s16, s48) in zip(program.scenes, speech):
            frames = math.ceil(Fraction(s48.size, AUDIO_RATE) * fps)
            windows = audio_windows_loop(whisper_features(s16, models), fps, frames)
            avatar = avatars[scene.shots[0].avatar]
            for start in range(0, frames, BATCH):
                idx = [ping_pong(scene.start_frame + math.floor(Fraction(j) / fps * avatar.fps), avatar.num_frames)
                       for j in range(start, min(frames, start + BATCH))]
                latents = avatar.latents[idx].to(models.device, models.dtype)
                with torch.inference_mode():
                    audio = models.pe(windows[start:start + len(idx)].to(models.device, models.dtype))
                    pred = models.unet(latents, audio)
                    faces = models.vae.decode(pred / VAE_SCALING_FACTOR)
                faces = ((faces.float() / 2 + 0.5).clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy()
                for k, face in zip(idx, faces):
                    x1, y1, x2, y2 = avatar.boxes[k].tolist()
                    body = Image.fromarray(_rgb(avatar.frames[k].numpy(), height, width, avatar.meta["colour_matrix"]))
                    face_img = Image.fromarray(cv2.resize(face, (x2 - x1, y2 - y1), interpolation=cv2.INTER_LINEAR))
                    mask = Image.fromarray(cv2.resize(avatar.masks[k].numpy(), (x2 - x1, y2 - y1)))
                    body.paste(face_img, (x1, y1, x2, y2), mask)
                    writer.write_rgb(np.asarray(body))
    wall = time.perf_counter() - t0
    first_frame = (writer.first_packet_at - t0) if writer.first_packet_at else wall
    return {"frames": writer.frames, "wall_s": wall, "fps": writer.frames / wall, "first_frame_s": first_frame,
            "disk_bytes_written": writer.disk_bytes_written}
