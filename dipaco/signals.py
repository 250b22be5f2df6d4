"""SIGINT and SIGTERM end a `dipaco` command through its `finally` blocks, never in the middle of an import.

    previous = stop_on_signals()            # dipaco.cli.main: each signal raises `Stopped` in the main thread
    try: ...
    except KeyboardInterrupt as stop: return exit_code(stop)  # 130 after SIGINT, 143 after SIGTERM
    finally: restore(previous)

A signal raises `Stopped` (a KeyboardInterrupt) wherever the main thread is, so every `finally` runs (the
train stage stops its island processes, an island joins its threads) and the process exits with 128 + the
signal's number, as a shell reports a process the signal ended. Not inside an import, though, nor inside
code run from a string (`PyRun_String`): an exception there leaves a module half initialised (torch's and
transformers' C++ extensions among those an island imports on start), after which the interpreter's exit
could abort (`terminate called without an active exception`, rc 134), and under `python -m` CPython ends
the process by SIGINT once a KeyboardInterrupt has left string code, even a caught one. A signal that
arrives there is raised `RETRY_SECONDS` later (SIGALRM), again until the import is over: deferred, never
dropped. A signal still deferred when the command returns is sent again once the old handlers are back.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

RETRY_SECONDS = 0.05
STOPPING = (signal.SIGINT, signal.SIGTERM)
# frames where an exception must not start: the import system's, and code compiled from a string
_DEFERRED_FILES = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>", "<string>")


class Stopped(KeyboardInterrupt):
    """A command stopped by `signum` (SIGINT or SIGTERM)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def exit_code(stop: KeyboardInterrupt) -> int:
    """128 + the signal's number (130 for a KeyboardInterrupt of no signal: Ctrl-C)."""
    return 128 + int(getattr(stop, "signum", signal.SIGINT))


def deferring(frame: FrameType | None) -> bool:
    """Is the main thread, stopped at `frame`, inside an import or code run from a string?"""
    while frame is not None:
        if frame.f_code.co_filename in _DEFERRED_FILES:
            return True
        frame = frame.f_back
    return False


class _Handlers:
    def __init__(self) -> None:
        self.pending: int | None = None  # a signal deferred until the import it came in is over

    def stop(self, signum: int, frame: FrameType | None) -> None:
        if deferring(frame):
            self.pending = self.pending or signum
            signal.setitimer(signal.ITIMER_REAL, RETRY_SECONDS)
            return
        self.pending = None
        raise Stopped(signum)

    def retry(self, _signum: int, frame: FrameType | None) -> None:
        if self.pending is not None:
            self.stop(self.pending, frame)


def stop_on_signals() -> tuple[_Handlers, dict] | None:
    """Install the handlers (module docstring); returns what `restore` needs (None outside the main thread,
    where handlers cannot be set: tests call `dipaco.cli.main` from other threads too)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    handlers = _Handlers()
    previous = {sig: signal.signal(sig, handlers.stop) for sig in STOPPING}
    previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, handlers.retry)
    return handlers, previous


def restore(installed: tuple[_Handlers, dict] | None) -> None:
    """Put the handlers `stop_on_signals` replaced back; a signal still deferred is sent again to them."""
    if installed is None:
        return
    handlers, previous = installed
    signal.setitimer(signal.ITIMER_REAL, 0)
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    if handlers.pending is not None:
        os.kill(os.getpid(), handlers.pending)
