"""Progress bars: live on a terminal, a few whole lines in a log file."""

import io

from modbench.progress import LOG_INTERVAL_S, progress_bar


def test_a_log_gets_whole_lines_not_every_refresh():
    log = io.StringIO()  # not a terminal
    bar = progress_bar(total=1000, desc="train", unit="step", file=log)
    for i in range(1000):
        if i % 10 == 0:
            bar.set_postfix(loss=f"{1 / (i + 1):.4f}")  # would redraw on every call on a terminal
        bar.update(1)
    bar.close()
    text = log.getvalue()
    lines = text.splitlines()
    assert "\r" not in text
    assert 1 <= len(lines) <= 3, lines  # the first draw, at most a timed redraw, the final state
    assert lines[-1].startswith("train: 100%") and "1000/1000" in lines[-1]
    assert LOG_INTERVAL_S >= 10


def test_a_terminal_gets_the_live_bar():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    bar = progress_bar(total=5, desc="x", file=tty)
    for _ in range(5):
        bar.update(1)
    bar.close()
    assert "\r" in tty.getvalue()  # redrawn in place
