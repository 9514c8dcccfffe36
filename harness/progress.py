"""Progress bars that suit where they are written: live on a terminal, a few lines in a log.

On a terminal ``progress_bar`` is an ordinary tqdm bar. Written to a file or a pipe (a CI log,
``nohup``, ``| tee``), tqdm would append every refresh — a postfix update and the tick after it
each redraw the bar, joined by carriage returns into one endless line. There the bar redraws at
most every ``LOG_INTERVAL_S`` seconds, postfix changes wait for the next redraw, and each redraw
is its own line.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

LOG_INTERVAL_S = 30.0


class _Lines:
    """A text stream that turns tqdm's carriage-return redraws into one line each."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        line = text.replace("\r", "").rstrip("\n")
        if line.strip():
            self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(*, interactive: bool | None = None, **kwargs: Any):
    """A tqdm bar; ``interactive`` defaults to whether stderr is a terminal."""
    from tqdm.auto import tqdm

    stream = kwargs.pop("file", None) or sys.stderr
    if interactive is None:
        interactive = bool(getattr(stream, "isatty", lambda: False)())
    if interactive:
        return tqdm(file=stream, dynamic_ncols=True, **kwargs)
    bar = tqdm(file=_Lines(stream), mininterval=LOG_INTERVAL_S, maxinterval=LOG_INTERVAL_S * 4, ncols=100, **kwargs)
    plain_postfix = bar.set_postfix
    bar.set_postfix = lambda *a, **kw: plain_postfix(*a, **{**kw, "refresh": False})  # shown at the next redraw
    return bar
