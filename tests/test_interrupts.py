"""Ctrl-C during a render: a flag checked at safe points, then the usual KeyboardInterrupt."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from lipstream.render.interrupts import DeferredInterrupt


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs in the main thread between bytecodes


def test_first_ctrl_c_waits_for_a_check_and_a_second_raises_at_once():
    before = signal.getsignal(signal.SIGINT)
    with DeferredInterrupt() as interrupt:
        _ctrl_c()
        assert interrupt.hit  # noted, nothing raised yet
        with pytest.raises(KeyboardInterrupt):
            interrupt.check()
        with pytest.raises(KeyboardInterrupt):
            _ctrl_c()
    assert signal.getsignal(signal.SIGINT) is before


def test_outside_the_main_thread_it_leaves_signals_alone():
    seen = []

    def run():
        with DeferredInterrupt() as interrupt:
            seen.append((interrupt.hit, signal.getsignal(signal.SIGINT)))
            interrupt.check()

    before = signal.getsignal(signal.SIGINT)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [(False, before)]
