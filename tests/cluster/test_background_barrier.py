"""The overlapped in-cluster sender's optimizer barrier (``cluster.background``), on a real
optimizer and real threads: the step waits until the version in flight reads nothing more AND
its detection has ended. A send that fails at once releases the parameters, but a detection
still running on its own thread reads θ, m and v: a step beside it would move them under it."""

from __future__ import annotations

import threading

import pytest
import torch

from deltasync.cluster.background import Background, PendingSend
from deltasync.errors import SendInterruptedError


def _failing_at_once(pending: PendingSend):
    raise RuntimeError("injected: the send failed before detection ended")


@pytest.mark.timeout(60)
def test_the_step_waits_for_detection_after_a_send_that_failed_at_once() -> None:
    p = torch.nn.Parameter(torch.ones(8))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones(8)
    settled: list[int] = []
    background = Background(
        [opt], thread_name="ds-test", settle=lambda pd: settled.append(pd.version)
    )
    pending = PendingSend(3, 0.0)
    background.submit(pending, _failing_at_once)
    with pytest.raises(RuntimeError, match="injected"):
        pending.result(30)
    assert pending.released() and not pending.detected()
    stepped = threading.Event()
    t = threading.Thread(target=lambda: (opt.step(), stepped.set()))
    t.start()
    assert not stepped.wait(0.5), "the step ran while detection still read the state"
    assert torch.equal(p.detach(), torch.ones(8)) and settled == []
    pending.end_detection()
    t.join(30)
    assert stepped.is_set() and settled == [3]  # settled once, before the step
    assert not torch.equal(p.detach(), torch.ones(8))
    background.close()


def _interrupted(pending: PendingSend):
    pending.end_detection()
    raise KeyboardInterrupt  # a Ctrl-C while the version is sent on the caller's thread


@pytest.mark.timeout(60)
def test_an_interrupt_on_the_callers_thread_leaves_a_failed_version_in_flight() -> None:
    # the caller sees the interrupt; the version stays in flight, done, its failure typed, for
    # the sender's next call to settle (the step must not wait for it forever)
    p = torch.nn.Parameter(torch.ones(8))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones(8)
    background = Background([opt], thread_name="ds-test")
    pending = PendingSend(4, 0.0)
    with pytest.raises(KeyboardInterrupt):
        background.run_here(pending, _interrupted)
    assert background.in_flight is pending and pending.done()
    with pytest.raises(SendInterruptedError, match="version 4") as err:
        pending.result(0)
    assert isinstance(err.value.__cause__, KeyboardInterrupt)
    t = threading.Thread(target=opt.step, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the step waits for a version that never ends"
    background.settled(PendingSend(5, 0.0))  # another version's settling leaves it in flight
    assert background.in_flight is pending
    background.settled(pending)
    assert background.in_flight is None
    background.close()


@pytest.mark.timeout(60)
def test_with_two_optimizers_the_step_that_waited_keeps_its_wait_on_record() -> None:
    # The second optimizer's barrier found the version released and wrote ~0 over the first
    # one's wait: the sender reported no barrier wait however long the step was held.
    import time

    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    sgd, adamw = torch.optim.SGD([a], lr=0.1), torch.optim.AdamW([b], lr=0.1)
    settled: list[int] = []
    background = Background(
        [sgd, adamw], thread_name="ds-test", settle=lambda pd: settled.append(pd.version)
    )
    pending = PendingSend(1, 0.0)
    pending.end_detection()

    def reading(p: PendingSend):
        time.sleep(0.5)  # the version still reads the parameters
        p.release()

    background.submit(pending, reading)
    a.grad, b.grad = torch.ones(4), torch.ones(4)
    sgd.step()  # held until the release
    adamw.step()
    assert background.barrier_wait_s >= 0.25
    assert settled == [1]  # settled once, by the step that waited
    pending.result(30)
    background.settled(pending)
    background.close()
