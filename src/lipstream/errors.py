"""One exception type for everything a user can cause: the CLI prints its message as one line.

Kept free of torch and of every other package, so anything may raise these."""

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


class UsageError(LipStreamError):
    """A command-line option with a value that is not allowed (exit status 2, like click's own)."""

    exit_code = 2
