"""Text scenes: text -> speech with no network. espeak-ng (Debian's package, a binary run per text) works on
a fresh machine; Piper (`piper-tts`, a neural voice in an .onnx file the user has) when it is installed.

A text scene becomes a WAV file (speak()), so the render treats it exactly like an `audio:` scene.
"""

from __future__ import annotations

import difflib
import io
import os
import re
import shutil
import subprocess
import wave
from functools import lru_cache
from pathlib import Path
from typing import Protocol

import numpy as np

from lipstream.errors import InputError, LipStreamError
from lipstream.files import check_file

DEFAULT_VOICE = "en"
ESPEAK = "espeak-ng"
INSTALL_ESPEAK = "apt-get install espeak-ng (or `make espeak`)"


class Voice(Protocol):
    """A TTS voice: `name` says which (the CLI prints it); speak() gives float32 mono samples and their rate."""

    name: str

    def speak(self, text: str) -> tuple[np.ndarray, int]: ...


class EspeakVoice:
    """An espeak-ng voice: a language ("en", "en-us", "de"), a voice file ("gmw/en-US") or a voice name
    ("English (America)"), optionally with a variant ("en+f3"). Checked against `espeak-ng --voices`."""

    def __init__(self, voice: str = DEFAULT_VOICE):
        self.binary = _espeak()
        _check_espeak_voice(self.binary, voice)
        self.voice = voice
        self.name = f"espeak-ng {voice}"

    def speak(self, text: str) -> tuple[np.ndarray, int]:
        # the text goes on stdin: one that starts with "-" is not read as an option
        done = subprocess.run([self.binary, "-v", self.voice, "--stdout"], input=text.encode(),
                              capture_output=True, check=False)
        if done.returncode != 0 or not done.stdout:
            problem = done.stderr.decode(errors="replace").strip().splitlines()
            raise LipStreamError(f"espeak-ng failed on voice {self.voice!r}: "
                                 f"{problem[-1] if problem else f'exit status {done.returncode}'}")
        return _read_wav(done.stdout)


class PiperVoice:
    """A Piper voice from its .onnx file (with its .onnx.json beside it), run by the `piper-tts` package."""

    def __init__(self, model: Path):
        self.model = check_file(model, "Piper voice file")
        config = Path(f"{self.model}.json")
        if not config.is_file():
            raise InputError(self.model, f"Piper voice has no config beside it (expected {config.name})")
        try:
            from piper import PiperVoice as _Piper  # noqa: PLC0415  (optional: only text scenes with a Piper voice)
        except ImportError:
            raise LipStreamError(f"the voice {self.model.name} needs Piper, which is not installed: "
                                 "pip install piper-tts") from None
        self._piper = _Piper
        self._voice = None
        self.name = f"piper {self.model.name}"

    def speak(self, text: str) -> tuple[np.ndarray, int]:
        if self._voice is None:
            self._voice = self._piper.load(str(self.model))
        buffer = io.BytesIO()
        with wave.open(buffer, "wb") as w:
            if hasattr(self._voice, "synthesize_wav"):  # piper-tts >= 1.3
                self._voice.synthesize_wav(text, w)
            else:  # piper-tts 1.2 writes the WAV from synthesize()
                self._voice.synthesize(text, w)
        return _read_wav(buffer.getvalue())


def pick_voice(voice: str | None) -> Voice:
    """None -> espeak-ng "en"; a path ending in .onnx -> Piper; anything else -> an espeak-ng voice.

    Raises LipStreamError (one line) for an unknown voice (with the closest names), a missing .onnx or
    its .json, piper-tts not installed, or espeak-ng not installed (naming the package).
    """
    if voice is None:
        return EspeakVoice(DEFAULT_VOICE)
    if voice.lower().endswith(".onnx"):
        return PiperVoice(Path(voice))
    return EspeakVoice(voice)


def speak(text: str, voice: Voice, path: Path) -> Path:
    """Speak `text` into a 16-bit mono WAV at `path` (written beside it, then renamed: a reader never sees
    half a file), at the voice's own rate; the render resamples it as any audio scene's file."""
    if not text.strip():
        raise LipStreamError("a text scene has no text to speak")
    samples, rate = voice.speak(text)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pcm = (np.clip(samples, -1.0, 1.0) * 32767).round().astype("<i2")
    try:
        with wave.open(str(tmp), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(rate)
            w.writeframes(pcm.tobytes())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _espeak() -> str:
    binary = shutil.which(ESPEAK)
    if binary is None:
        raise LipStreamError(f"text scenes need espeak-ng, which is not installed: {INSTALL_ESPEAK}")
    return binary


def _check_espeak_voice(binary: str, voice: str) -> None:
    base, _, variant = voice.partition("+")
    voices, variants = _espeak_voices(binary)
    if base.lower() not in voices:
        close = difflib.get_close_matches(base.lower(), sorted(voices), n=4, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else "; `espeak-ng --voices` lists them"
        raise LipStreamError(f"unknown espeak-ng voice {voice!r}{hint}")
    if variant and variant not in variants:  # espeak-ng silently ignores an unknown variant
        close = difflib.get_close_matches(variant, sorted(variants), n=4, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else "; `espeak-ng --voices=variant` lists them"
        raise LipStreamError(f"unknown espeak-ng variant {variant!r} in {voice!r}{hint}")


@lru_cache(maxsize=4)
def _espeak_voices(binary: str) -> tuple[frozenset[str], frozenset[str]]:
    """What `-v` takes, lower-cased: languages, voice files, voice names (underscores read as spaces) and
    the other languages a voice speaks; and the variant names (case matters: they are file names)."""
    def table(*args: str) -> list[list[str]]:
        out = subprocess.run([binary, *args], capture_output=True, text=True, check=False).stdout
        return [line.split(None, 5) for line in out.splitlines()[1:] if len(line.split()) >= 5]

    voices: set[str] = set()
    for row in table("--voices"):
        voices.update(x.lower() for x in (row[1], row[4], row[3].replace("_", " ")))
        if len(row) > 5:
            voices.update(x.lower() for x in re.findall(r"\(([^\s)]+)\s+\d+\)", row[5]))
    variants = {row[4].rsplit("/", 1)[-1] for row in table("--voices=variant")}
    return frozenset(voices), frozenset(variants)


def _read_wav(data: bytes) -> tuple[np.ndarray, int]:
    """16-bit PCM WAV bytes -> float32 mono samples and rate. espeak-ng streams its WAV with the sizes left
    open (0x7fffffff), so the data is read to its end, whatever the header says."""
    with wave.open(io.BytesIO(data)) as w:
        if w.getsampwidth() != 2:
            raise LipStreamError(f"TTS gave {8 * w.getsampwidth()}-bit audio, expected 16-bit PCM")
        channels, rate = w.getnchannels(), w.getframerate()
        raw = w.readframes(w.getnframes())
    pcm = np.frombuffer(raw[: len(raw) // (2 * channels) * 2 * channels], "<i2").reshape(-1, channels)
    return (pcm.mean(axis=1) / 32768.0).astype(np.float32), rate
