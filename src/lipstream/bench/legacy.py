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
from lipstream.avatar.colour import yuv_to_rgb_affine
from lipstream.audio.features import whisper_features
from lipstream.audio.windows import audio_windows_loop
from lipstream.io import atomic_path
from lipstream.media.mp4 import AUDIO_RATE
from lipstream.models import MuseTalk
from lipstream.models.config import VAE_SCALING_FACTOR
from lipstream.render import load_speech, resolve_avatar
from lipstream.script import Program

BATCH = 20  # upstream's default batch size


def _rgb(i420: np.ndarray, height: int, width: int, matrix: str) -> np.ndarray:
    y = i420[:height]
    u = cv2.resize(i420[height:].reshape(-1)[: height * width // 4].reshape(height // 2, width // 2), (width, height),
                   interpolation=cv2.INTER_NEAREST)
    v = cv2.resize(i420[height:].reshape(-1)[height * width // 4:].reshape(height // 2, width // 2), (width, height),
                   interpolation=cv2.INTER_NEAREST)
    return cv2.transform(cv2.merge([y, u, v]), yuv_to_rgb_affine(matrix))


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
    work = Path(tempfile.mkdtemp(prefix="lipstream-legacy-"))
    written = 0
    first_frame_s = None
    try:
        frames_dir = work / "frames"
        frames_dir.mkdir()
        audio_parts, n = [], 0
        for scene in program.scenes:
            s16, s48 = load_speech(scene.audio, models.device)
            audio_parts.append(s48)
            frames = math.ceil(Fraction(s48.size, AUDIO_RATE) * fps)
            windows = audio_windows_loop(whisper_features(s16, models.whisper, models.feature_extractor), fps, frames)
            avatar = avatars[scene.shots[0].avatar]
            for start in range(0, frames, BATCH):
                idx = [ping_pong(scene.start_frame + math.floor(Fraction(j) / fps * avatar.fps), avatar.num_frames)
                       for j in range(start, min(frames, start + BATCH))]
                latents = avatar.latents[idx].to(models.device, models.dtype)
                with torch.inference_mode():
                    audio = models.pe(windows[start:start + len(idx)].to(models.device, models.dtype))
                    pred = models.unet(latents, torch.tensor([0], device=models.device),
                                       encoder_hidden_states=audio).sample
                    faces = models.vae.decode(pred / VAE_SCALING_FACTOR).sample
                faces = ((faces.float() / 2 + 0.5).clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).cpu().numpy()
                for k, face in zip(idx, faces):
                    x1, y1, x2, y2 = avatar.boxes[k].tolist()
                    body = Image.fromarray(_rgb(avatar.frames[k].numpy(), height, width, avatar.meta["colour_matrix"]))
                    face_img = Image.fromarray(cv2.resize(face, (x2 - x1, y2 - y1), interpolation=cv2.INTER_LINEAR))
                    mask = Image.fromarray(cv2.resize(avatar.masks[k].numpy(), (x2 - x1, y2 - y1)))
                    body.paste(face_img, (x1, y1, x2, y2), mask)
                    png = frames_dir / f"{n:08d}.png"
                    cv2.imwrite(str(png), cv2.cvtColor(np.asarray(body), cv2.COLOR_RGB2BGR))
                    written += png.stat().st_size
                    n += 1
        silent = work / "video.mp4"  # first encode: PNG sequence -> video without audio
        with av.open(str(silent), "w") as c:
            stream = c.add_stream("libx264", rate=fps, options={"crf": "18", "preset": "veryfast"})
            stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
            for i in range(n):
                bgr = cv2.imread(str(frames_dir / f"{i:08d}.png"))
                for p in stream.encode(av.VideoFrame.from_ndarray(bgr, format="bgr24")):
                    c.mux(p)
            for p in stream.encode(None):
                c.mux(p)
        written += silent.stat().st_size
        audio = np.concatenate(audio_parts)
        with atomic_path(output) as tmp, av.open(str(silent)) as src, \
                av.open(str(tmp), "w", format="mp4") as dst:  # second encode: video again, plus the audio
            v = dst.add_stream("libx264", rate=fps, options={"crf": "18", "preset": "veryfast"})
            v.width, v.height, v.pix_fmt = width, height, "yuv420p"
            a = dst.add_stream("aac", rate=AUDIO_RATE, layout="mono")
            for i, frame in enumerate(src.decode(video=0)):
                frame.pts, frame.time_base = i, 1 / fps
                for p in v.encode(frame):
                    dst.mux(p)
                    first_frame_s = first_frame_s or time.perf_counter() - t0
            for p in v.encode(None):
                dst.mux(p)
            for i in range(0, audio.size, 1024):
                af = av.AudioFrame.from_ndarray(audio[None, i:i + 1024], format="fltp", layout="mono")
                af.sample_rate, af.pts = AUDIO_RATE, i
                for p in a.encode(af):
                    dst.mux(p)
            for p in a.encode(None):
                dst.mux(p)
        wall = time.perf_counter() - t0
        return {"frames": n, "wall_s": wall, "fps": n / wall, "first_frame_s": first_frame_s or wall,
                "disk_bytes_written": written}
    finally:
        shutil.rmtree(work, ignore_errors=True)
