"""One exception type for everything a user can cause: the CLI prints its message as one line."""

from __future__ import annotations

from pathlib import Path


class LipStreamError(Exception):
    """A problem with the user's input or environment, described in one line.

    The CLI prints `error: <message>` and exits 1 instead of showing a traceback.
    """


class InputError(LipStreamError):
    """A file the user gave us is missing, unreadable, or not what it should be."""

    def __init__(self, path: str | Path, problem: str):
        self.path = Path(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


class WeightsError(LipStreamError):
    """A model file is missing, corrupt, or does not match its architecture."""


def check_file(path: str | Path, what: str = "file") -> Path:
    """Return `path` as a Path if it is an existing, readable, regular file; else raise InputError."""
    p = Path(path)
    if not p.exists():
        raise InputError(p, f"no such {what}")
    if p.is_dir():
        raise InputError(p, f"is a folder, expected {_a(what)}")
    if not p.is_file():
        raise InputError(p, f"is not a regular file, expected {_a(what)}")
    try:
        with open(p, "rb"):
            pass
    except OSError as e:
        raise InputError(p, f"cannot be read ({e.strerror or e})") from None
    return p


def _a(noun: str) -> str:
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"
