"""Ctrl-C at the two moments of an overlapped ``TrainerSync`` where it cost exactness or told
a falsehood: right after the tracker's ``clear()`` (the version's changes were neither carried
nor in flight, so the next delta missed them and every receiver refused it), and after the
manifest was stored while ``LATEST`` was advanced (a committed version reported as "did not
commit")."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from kit import bits_equal, expected_shards, rconfig, tiny_layouts, zero_tensors

from deltasync import names
from deltasync.errors import PublishFailedError, SendInterruptedError
from deltasync.publish import Publisher, TrainerSync
from deltasync.publish import publisher as publisher_mod
from deltasync.receiver import Receiver
from deltasync.store import LocalStore
from deltasync.trainer import AdamWTracker


@pytest.fixture(autouse=True)
def _ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt here, whatever handler an earlier test left behind."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class _CtrlCAt:
    """A store that delivers SIGINT when ``key`` is written, once armed."""

    def __init__(self, inner, key: str) -> None:
        self.inner, self.key, self.armed = inner, key, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put(self, key, data):
        if self.armed and key == self.key:
            self.armed = False
            signal.raise_signal(signal.SIGINT)
        return self.inner.put(key, data)


class _CtrlCAsTheManifestIsStored(_CtrlCAt):
    """A store that delivers SIGINT as the write of version ``version``'s manifest (the commit
    point) returns, once armed."""

    def __init__(self, inner, version: int) -> None:
        super().__init__(inner, names.manifest_key(version))

    def put_if_absent(self, key, data):
        done = self.inner.put_if_absent(key, data)
        if self.armed and key == self.key:
            self.armed = False
            signal.raise_signal(signal.SIGINT)
        return done


class _Rig:
    def __init__(self, tmp_path, *, store=None, **sync_options) -> None:
        _, self.tl, self.rl = tiny_layouts()
        g = torch.Generator().manual_seed(0)
        self.params = {
            n: torch.nn.Parameter(torch.randn(s, generator=g) * 0.02)
            for n, s in self.tl.param_shapes().items()
        }
        self.opt = torch.optim.AdamW(self.params.values(), lr=1e-3)
        inner = LocalStore(tmp_path / "store", durable=False)
        self.store = store(inner) if store else inner
        self.tracker = AdamWTracker(self.opt, list(self.params.items()))
        pub = Publisher(self.store, receiver_layout=self.rl, trainer_layout=self.tl)
        self.sync = TrainerSync(
            self.tracker, pub, self.params, overlap=True, optimizer=self.opt, **sync_options
        )
        self.receivers = [
            Receiver.for_layout(
                inner,
                self.rl,
                s.id,
                zero_tensors(self.rl, s.id),
                str(tmp_path / s.id),
                rconfig(f"rx-{s.id}"),
            )
            for s in self.rl.shards()
        ]
        self.gen = torch.Generator().manual_seed(5)

    def step(self) -> None:
        self.opt.zero_grad()
        for p in self.params.values():
            mask = torch.rand(p.shape, generator=self.gen) < 0.05
            p.grad = torch.where(mask, torch.randn(p.shape, generator=self.gen), 0.0)
        self.opt.step()

    def check(self, version: int) -> None:
        want = expected_shards(self.params, self.tl, self.rl)
        for rec in self.receivers:
            assert rec.pull().version == version, rec.shard
            for n, t in want[rec.shard].items():
                assert bits_equal(rec.tensors[n], t), (rec.shard, n, version)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "options",
    [{}, {"inline_below": 0, "detect_in_background": False}],
    ids=["small-delta-published-inline", "large-delta-published-in-background"],
)
def test_ctrl_c_right_after_the_trackers_clear_loses_no_change(tmp_path, options):
    # clear() runs on the caller's thread in both (a signal interrupts only that thread)
    rig = _Rig(tmp_path, **options)
    rig.sync.step_published(0, anchor=True)
    rig.sync.wait()
    rig.step()
    clear = rig.tracker.clear

    def clear_then_ctrl_c():
        clear()
        signal.raise_signal(signal.SIGINT)

    rig.tracker.clear = clear_then_ctrl_c
    with pytest.raises(KeyboardInterrupt):
        rig.sync.step_published(1)
    rig.tracker.clear = clear
    try:
        rig.sync.wait()
    except PublishFailedError:
        pass  # version 1's fate is the next call's to report; its changes must survive it
    rig.step()
    version = rig.sync.next_version()
    rig.sync.step_published(version)
    rig.sync.wait()
    rig.check(version)  # every change of both steps, or the receivers refuse the delta


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "store",
    [lambda inner: _CtrlCAt(inner, "LATEST"), lambda inner: _CtrlCAsTheManifestIsStored(inner, 1)],
    ids=["while-latest-advances", "as-the-manifest-write-returns"],
)
def test_ctrl_c_after_the_commit_point_reports_the_committed_version_as_committed(tmp_path, store):
    rig = _Rig(tmp_path, store=store)
    rig.sync.step_published(0, anchor=True)
    rig.sync.wait()
    rig.step()
    rig.store.armed = True
    with pytest.raises(KeyboardInterrupt):
        rig.sync.step_published(1)  # a small delta: published on the caller's thread
    rig.check(1)  # the store committed it: every receiver takes it
    with pytest.raises(PublishFailedError, match="version 1 committed") as info:
        rig.sync.wait()
    assert info.value.version == 1 and rig.sync.baseline == 1
    rig.step()
    rig.sync.step_published(2)
    rig.sync.wait()
    rig.check(2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("anchor", [True, False], ids=["anchor", "large-delta"])
def test_ctrl_c_before_a_thread_takes_the_version_leaves_nothing_to_wait_for_forever(
    tmp_path, anchor
):
    rig = _Rig(tmp_path, inline_below=0, detect_in_background=False)
    if not anchor:
        rig.sync.step_published(0, anchor=True)
        rig.sync.wait()
        rig.step()
    submit = rig.sync._submit

    def ctrl_c_instead(*args):
        rig.sync._submit = submit
        raise KeyboardInterrupt

    rig.sync._submit = ctrl_c_instead
    version = 0 if anchor else 1
    with pytest.raises(KeyboardInterrupt):
        rig.sync.step_published(version, anchor=anchor)
    try:
        rig.sync.wait()  # returns, whether or not the version was in flight: no thread took it
    except PublishFailedError as exc:
        assert f"version {version} did not commit" in str(exc), exc
    if anchor:
        rig.sync.step_published(0, anchor=True)
        rig.sync.wait()
    rig.step()
    version = rig.sync.next_version()
    rig.sync.step_published(version)
    rig.sync.wait()
    rig.check(version)


class _CtrlCOnSubmit:
    """An executor whose next ``submit`` is preceded by a Ctrl-C, as if it landed in the
    statements that start a thread's work."""

    def __init__(self, inner) -> None:
        self.inner, self.armed = inner, True

    def submit(self, *args, **kwargs):
        if self.armed:
            self.armed = False
            signal.raise_signal(signal.SIGINT)
        return self.inner.submit(*args, **kwargs)

    def shutdown(self, *args, **kwargs):
        return self.inner.shutdown(*args, **kwargs)


@pytest.mark.timeout(120, method="thread")
def test_ctrl_c_while_detection_is_handed_to_its_thread_leaves_nothing_waiting_forever(tmp_path):
    # a large delta whose detection goes on on the detection thread after the return
    rig = _Rig(tmp_path, inline_below=0)
    rig.sync.step_published(0, anchor=True)
    rig.sync.wait()
    rig.step()
    rig.sync._detector = _CtrlCOnSubmit(ThreadPoolExecutor(1))
    with pytest.raises(KeyboardInterrupt):
        rig.sync.step_published(1)
    # returns: the version in flight is one whose detection runs; named as interrupted,
    # unless the detection thread closed its handoff before the held Ctrl-C was delivered
    # (the interrupt lands at the end of the hand-off's statements; a tiny model's
    # detection may be done by then), in which case it commits whole
    try:
        rig.sync.wait()
    except PublishFailedError as failed:
        assert "version 1 did not commit" in str(failed), failed
        assert "interrupted (KeyboardInterrupt)" in str(failed), failed
        assert isinstance(failed.__cause__, SendInterruptedError)
        assert isinstance(failed.__cause__.__cause__, KeyboardInterrupt)
    else:
        rig.check(1)
    rig.step()  # the barrier lets the step through
    version = rig.sync.next_version()
    rig.sync.step_published(version)
    rig.sync.wait()
    rig.check(version)


@pytest.mark.timeout(120, method="thread")
def test_ctrl_c_while_an_upload_starts_leaks_no_upload_thread(tmp_path, monkeypatch):
    # a small delta, published on this thread, with its blobs streamed to upload threads
    # (not held whole): the uploads start on this thread
    monkeypatch.setattr(publisher_mod, "HELD_BELOW", 0)
    rig = _Rig(tmp_path)
    rig.sync.step_published(0, anchor=True)
    rig.sync.wait()
    pub = rig.sync.publishers[0]
    pub._pool = _CtrlCOnSubmit(pub._pool)  # the first blob's upload of the next version
    rig.step()
    with pytest.raises(KeyboardInterrupt):
        rig.sync.step_published(1)
    try:
        rig.sync.wait()
    except PublishFailedError as exc:
        assert "version 1 did not commit" in str(exc), exc
    for _ in range(3):  # a leaked upload thread would leave later blobs waiting forever
        rig.step()
        version = rig.sync.next_version()
        rig.sync.step_published(version)
        rig.sync.wait()
        rig.check(version)


@pytest.mark.timeout(120, method="thread")
def test_ctrl_c_while_a_held_blob_is_stored_commits_nothing_and_loses_no_change(tmp_path):
    # a small delta's blobs are held and stored whole on this thread: Ctrl-C in the second
    # shard's put leaves the first shard's blob without a manifest, never a committed version
    version = 1
    rig = _Rig(tmp_path, store=lambda inner: _CtrlCAt(inner, ""))
    rig.sync.step_published(0, anchor=True)
    rig.sync.wait()
    rig.store.key = names.blob_key(version, "tp1", rig.sync.publishers[0].writer)
    rig.step()
    rig.store.armed = True
    with pytest.raises(KeyboardInterrupt):
        rig.sync.step_published(version)
    assert not rig.store.armed, "the held blob was not stored through put"
    with pytest.raises(PublishFailedError, match="version 1 did not commit"):
        rig.sync.wait()
    assert not rig.store.exists(names.manifest_key(version))
    rig.step()
    version = rig.sync.next_version()
    rig.sync.step_published(version)  # carries version 1's changes
    rig.sync.wait()
    rig.check(version)
