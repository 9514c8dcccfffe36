"""Ctrl-C and SIGTERM as a request to stop at the next safe point, never a lost one.

Python runs a signal handler between two bytecodes of the main thread, wherever that thread
is. A ``KeyboardInterrupt`` raised from the handler can therefore land inside a weakref or
garbage-collector callback, where Python prints "Exception ignored" and drops it (seen in CI:
SQLAlchemy's ``_collection_gced``; the study then ran to its end and exited 0), or half-way
through a store write. So, inside :func:`deferred`, the handler only records the request, and
the work checks it where stopping is safe: every training step, every evaluation batch, and
between trials. A second signal raises at once, for a user who will not wait for that point.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_requested: int | None = None  # the signal number of the pending request, if any


def _record(signum: int, frame: object) -> None:
    global _requested
    if _requested is not None:
        raise KeyboardInterrupt  # the second one: stop now
    _requested = signum


def requested() -> bool:
    """Whether a stop was asked for and not yet acted on."""
    return _requested is not None


def check() -> None:
    """Raise ``KeyboardInterrupt`` here if a stop was asked for (a safe point)."""
    if _requested is not None:
        raise KeyboardInterrupt


@contextmanager
def deferred() -> Iterator[None]:
    """SIGINT and SIGTERM only record a request inside this block (main thread only; elsewhere
    Python delivers no signals and the block changes nothing). On exit the previous handlers
    come back and any request not acted on is dropped."""
    global _requested
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _record) for s in _SIGNALS}
    _requested = None
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _requested = None
