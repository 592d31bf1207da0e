"""One SIGALRM deadline for a block of code, shared by the phase deadlines (``engine.workers``)
and the custom-scorer calls (``reward.manager``): the block is interrupted at its next bytecode
by the exception ``expired()`` returns. Signals reach only the main thread, and only where
``setitimer`` exists; elsewhere the block runs without this deadline."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable


@contextlib.contextmanager
def alarm(seconds: float, expired: Callable[[], BaseException]):
    if (seconds <= 0 or not hasattr(signal, "setitimer")
            or threading.current_thread() is not threading.main_thread()):
        yield
        return

    def on_alarm(signum, frame):
        raise expired()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
