"""Ctrl-C that stops a render where it can stop cleanly.

Python raises KeyboardInterrupt wherever the main thread happens to be. Inside a queue's
condition wait that can leave the lock half released, and the interrupt then surfaces as
"RuntimeError: release unlocked lock" with a traceback instead of a clean stop. So while a render
loop runs, the first Ctrl-C only sets a flag that the loop checks at safe points; a second one
raises at once.
"""

from __future__ import annotations

import signal
import threading


class DeferredInterrupt:
    """`with DeferredInterrupt() as interrupt: ... interrupt.check() ...` (main thread only; elsewhere a no-op)."""

    def __init__(self) -> None:
        self.hit = False
        self._previous = None
        self._active = False

    def __enter__(self) -> DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._handle)
            self._active = True
        return self

    def _handle(self, signum, frame) -> None:
        if self.hit:
            raise KeyboardInterrupt  # a second Ctrl-C: now
        self.hit = True

    def check(self) -> None:
        """Raise KeyboardInterrupt here if Ctrl-C was pressed."""
        if self.hit:
            raise KeyboardInterrupt

    def __exit__(self, *exc) -> None:
        if self._active:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None else signal.SIG_DFL)
            self._active = False
