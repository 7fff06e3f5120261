"""One exception type for everything a user can cause: the CLI prints its message as one line.

Kept free of torch and of every other package, so anything may raise these; and the one place that says
which optional extra brings which packages (`require`)."""

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


# The optional extras (pyproject.toml's optional-dependencies): the modules each brings and, where a user
# decides by it, a note. `require` is the one place a missing extra is named.
EXTRAS = {
    "serve": ("fastapi", "uvicorn", "prometheus_client", "websockets", "aiortc", "httpx"),
    "postgres": ("psycopg",),
    "ray": ("ray", "ray.serve"),
    "dlib": ("dlib", "face_recognition_models"),
    "pipecat": ("pipecat",),
    "livekit": ("livekit.agents", "livekit.rtc", "livekit.api"),
}
EXTRA_NOTES = {"dlib": "its 68-point model's training data is for non-commercial use"}


class MissingExtra(LipStreamError, ImportError):
    """An optional extra that is not installed; the message names the `pip install` that brings it. An
    ImportError too, for `import lipstream.integrations.pipecat` and the like."""

    def __init__(self, extra: str, what: str, missing: str, otherwise: str = ""):
        self.extra = extra
        note = f" ({EXTRA_NOTES[extra]})" if extra in EXTRA_NOTES else ""
        super().__init__(f"{what} needs the {extra} extra: pip install 'lipstream[{extra}]'{note}"
                         + (f"; or {otherwise}" if otherwise else ""), name=missing)


def installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (a dotted name imports its parents)."""
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent missing, or a module without a spec
        return False


def require(extra: str, what: str, *modules: str, otherwise: str = "") -> None:
    """Raise MissingExtra, naming `extra`, unless each of `modules` (default: all the extra brings) is
    installed. `what`: who needs it ("lipstream serve"); `otherwise`: another way, if there is one."""
    for module in modules or EXTRAS[extra]:
        if not installed(module):
            raise MissingExtra(extra, what, module, otherwise)
