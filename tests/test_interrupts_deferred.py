"""``interrupts_deferred``: a SIGINT inside the block reaches the installed handler as the block
ends, never in the middle; off the main thread, and for a handler Python did not install, the
block changes nothing."""

from __future__ import annotations

import signal
import threading

import pytest

from deltasync.interrupts import interrupts_deferred


@pytest.fixture
def handler():
    """Install a handler for the test; restore the runner's afterwards."""
    previous = signal.getsignal(signal.SIGINT)
    yield lambda h: signal.signal(signal.SIGINT, h)
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_inside_the_block_is_raised_when_it_ends(handler) -> None:
    handler(signal.default_int_handler)
    ran = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            ran.append("after the signal")  # the block is not cut in two
    assert ran == ["after the signal"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_installed_handler_gets_the_signal_once_nested_blocks_end(handler) -> None:
    got = []
    handler(lambda signum, frame: got.append(signum))
    with interrupts_deferred():
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
        assert got == []  # the outer block still holds it
    assert got == [signal.SIGINT]


def test_an_ignored_sigint_stays_ignored_and_no_signal_is_no_call(handler) -> None:
    handler(signal.SIG_IGN)
    with interrupts_deferred():
        signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    got = []
    handler(lambda signum, frame: got.append(signum))
    with interrupts_deferred():
        pass
    assert got == []


def test_off_the_main_thread_the_block_leaves_the_handler_alone(handler) -> None:
    handler(signal.default_int_handler)
    seen = []

    def run() -> None:
        with interrupts_deferred():
            seen.append(signal.getsignal(signal.SIGINT))

    t = threading.Thread(target=run)
    t.start()
    t.join(10)
    assert seen == [signal.default_int_handler]


def test_an_error_in_the_block_restores_the_handler(handler) -> None:
    handler(signal.default_int_handler)
    with pytest.raises(ValueError):
        with interrupts_deferred():
            raise ValueError("inside")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.fixture
def term_handler():
    previous = signal.getsignal(signal.SIGTERM)
    yield lambda h: signal.signal(signal.SIGTERM, h)
    signal.signal(signal.SIGTERM, previous)


class Terminated(Exception):
    pass


def _raise_terminated(signum, frame):
    raise Terminated(signum)


def test_a_sigterm_a_python_handler_takes_is_held_like_a_ctrl_c(term_handler) -> None:
    term_handler(_raise_terminated)
    ran = []
    with pytest.raises(Terminated):
        with interrupts_deferred():
            signal.raise_signal(signal.SIGTERM)
            ran.append("after the signal")
    assert ran == ["after the signal"]
    assert signal.getsignal(signal.SIGTERM) is _raise_terminated


def test_a_sigterm_with_the_default_action_is_not_held(term_handler) -> None:
    term_handler(signal.SIG_DFL)
    with interrupts_deferred():
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_ctrl_c_and_a_sigterm_held_together_both_reach_their_handlers(
    handler, term_handler
) -> None:
    handler(signal.default_int_handler)
    got = []
    term_handler(lambda signum, frame: got.append(signum))
    with pytest.raises(KeyboardInterrupt):
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGTERM)
    for _ in range(1000):  # the SIGTERM, sent again, is handled at the next check
        if got:
            break
    assert got == [signal.SIGTERM]
