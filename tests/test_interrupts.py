"""Ctrl-C and SIGTERM are requests acted on at safe points: none is lost, none lands mid-write.

The signals are sent by the test process to itself, so each test is driven by the event, not
by timing: Python runs the handler at the next bytecode boundary of the main thread.
"""

import gc
import os
import signal
import sys
import weakref

import pytest

from modbench import interrupts
from modbench.config.model import ModelConfig, RoutingConfig
from modbench.config.run import RunConfig, TrainConfig
from modbench.run.train import train


class _Resource:
    pass


def _signal_inside_a_weakref_callback(sig: int) -> None:
    """Deliver ``sig`` while Python runs a weakref callback, as SQLAlchemy's ``_collection_gced``
    did in CI: an exception raised there is printed as "Exception ignored" and dropped."""
    def callback(_ref) -> None:
        os.kill(os.getpid(), sig)
        for _ in range(1000):  # bytecodes inside the callback: the handler runs here
            pass

    obj = _Resource()
    ref = weakref.ref(obj, callback)
    del obj
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_inside_a_callback_is_kept_until_the_next_safe_point(sig):
    with interrupts.deferred():
        _signal_inside_a_weakref_callback(sig)
        assert interrupts.requested()
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()


def test_without_deferral_the_same_interrupt_is_lost(monkeypatch):
    """Why the module exists: Python's own SIGINT handler raises inside the callback, and the
    interrupt goes to ``sys.unraisablehook`` ("Exception ignored") instead of to the program."""
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", dropped.append)
    # Python's own handler, set here: a process started in the background (`cmd &` in a script)
    # inherits SIGINT ignored, and Python then keeps it ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _signal_inside_a_weakref_callback(signal.SIGINT)  # no KeyboardInterrupt reaches us
    finally:
        signal.signal(signal.SIGINT, previous)
    assert [type(u.exc_value) for u in dropped] == [KeyboardInterrupt]


def test_a_second_signal_stops_at_once_and_handlers_come_back():
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with interrupts.deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        assert interrupts.requested()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
    assert {s: signal.getsignal(s) for s in before} == before
    assert not interrupts.requested()  # a request not acted on does not outlive the block
    interrupts.check()


def test_training_stops_at_the_step_after_the_signal(tmp_cwd):
    """SIGINT during the first evaluation (step 10 of 40): the run stops before step 11's
    evaluation, and the signal does not escape as an exception from inside the evaluation."""
    cfg = RunConfig(ModelConfig(depth=2, n_embd=64, head_dim=16, max_seq_len=64), RoutingConfig("sigmoid", 0.25),
                    TrainConfig(dataset="arithmetic", seq_len=64, batch_size=8, budget="steps=40", eval_every=10,
                                log_every=5, eval_windows=8, track=False, out_dir="runs"))
    evaluated: list[int] = []

    def on_eval(step: int, val: dict[str, float]) -> None:
        evaluated.append(step)
        os.kill(os.getpid(), signal.SIGINT)

    with interrupts.deferred(), pytest.raises(KeyboardInterrupt):
        train(cfg, progress=False, on_eval=on_eval)
    assert evaluated == [10]
