"""The S3 server goes away in the middle of a publish (the loopback moto server is stopped and
restarted on its port). A short outage is ridden out by the store's retries; one longer than
the retry deadline fails the publish cleanly (nothing visible, the tracker keeps its bits), and
the retry after the server is back converges bit-exactly."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from deltasync import names
from deltasync.errors import StoreError
from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.receiver import Receiver
from deltasync.store import RetryPolicy, S3Store
from deltasync.trainer import SnapshotTracker

from sync_kit import (
    GateStore,
    TinyTrainer,
    assert_same_bits,
    expected_shards,
    layouts,
    rconfig,
    tiny_layouts,
    zero_tensors,
)


@pytest.fixture
def s3_outage(s3_server):
    """Stops the session's server on demand; always leaves it running afterwards."""
    yield s3_server
    if not s3_server.running:
        s3_server.start()


def _rig(s3_server, s3_session_store, tmp_path, retry):
    spec, tl, rl = layouts()
    prefix = f"outage-{uuid.uuid4().hex[:8]}"
    store = S3Store(s3_session_store.bucket, prefix, config=s3_server.config(retry=retry))
    reader = s3_session_store.with_prefix(prefix)
    trainer = TinyTrainer(spec)
    outage = {"armed": None}

    def gate(op, key):
        hit = outage["armed"]
        if hit is not None and hit(op, key):
            outage["armed"] = None
            outage["hook"]()

    pub = Publisher(GateStore(store, gate), receiver_layout=rl, config=PublisherConfig())
    sync = TrainerSync(SnapshotTracker(trainer.named_parameters()), pub, trainer.params)
    rec = Receiver.for_layout(
        reader, rl, "tp1", zero_tensors(rl, "tp1"), str(tmp_path / "r"), rconfig("r")
    )
    return tl, rl, trainer, sync, rec, outage, store


@pytest.mark.timeout(60)
def test_an_s3_restart_mid_publish_is_ridden_out_by_the_retries(
    s3_outage, s3_session_store, tmp_path
):
    retry = RetryPolicy(max_attempts=30, base_delay_s=0.05, max_delay_s=0.2, deadline_s=15.0)
    tl, rl, trainer, sync, rec, outage, store = _rig(s3_outage, s3_session_store, tmp_path, retry)
    sync.step_published(0)
    trainer.step()

    def restart_soon():  # down now, back in 0.5 s
        s3_outage.stop()
        threading.Timer(0.5, s3_outage.start).start()

    outage["hook"] = restart_soon
    outage["armed"] = lambda op, key: op == "mid-stream" and key.endswith(".blob")
    report = sync.step_published(1)[0]
    assert report.kind == "delta" and outage["armed"] is None
    assert rec.pull().version == 1
    assert_same_bits(rec.tensors, expected_shards(trainer.params, tl, rl)["tp1"])
    store.close()


@pytest.mark.timeout(60)
def test_an_outage_longer_than_the_retry_deadline_fails_cleanly_and_a_retry_converges(
    s3_outage, s3_session_store, tmp_path
):
    retry = RetryPolicy(max_attempts=3, base_delay_s=0.05, max_delay_s=0.1, deadline_s=0.5)
    tl, rl, trainer, sync, rec, outage, store = _rig(s3_outage, s3_session_store, tmp_path, retry)
    sync.step_published(0)
    trainer.step()
    outage["hook"] = s3_outage.stop
    outage["armed"] = lambda op, key: op == "put_if_absent" and key.endswith(names.MANIFEST_FILE)
    with pytest.raises(StoreError, match="attempts"):
        sync.step_published(1)
    assert sync.baseline == 0, "the tracker keeps its bits until a commit"
    s3_outage.start()
    assert rec.pull().version == 0, "nothing of the failed attempt is visible"
    trainer.step()  # training went on: the retry (as a new version) sends everything since 0
    report = sync.step_published(2)[0]
    assert report.kind == "delta" and report.base_version == 0
    assert rec.pull().chain == (2,)
    assert_same_bits(rec.tensors, expected_shards(trainer.params, tl, rl)["tp1"])
    store.close()


class _DownAtLastBlob:
    """An S3 store that goes away as the last shard's blob is uploaded, once the other blobs
    of the version have landed (an outage in the middle of a version's uploads)."""

    def __init__(self, inner, server, last: str, blobs: int) -> None:
        self.inner, self.server, self.last, self.blobs = inner, server, last, blobs
        self.down_at: float | None = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_stream(self, key, chunks):
        if key.endswith(".blob") and f"/{self.last}/" in key:
            chunks = list(chunks)  # the version's last bytes: the other blobs are finishing
            deadline = time.monotonic() + 20
            while len([k for k in self.inner.list("v") if k.endswith(".blob")]) < self.blobs:
                assert time.monotonic() < deadline, "the other blobs never landed"
                time.sleep(0.05)
            self.server.stop()
            self.down_at = time.monotonic()
        return self.inner.put_stream(key, chunks)


@pytest.mark.timeout(60)
def test_an_outage_mid_upload_fails_after_a_deadline_or_two_never_one_per_stored_blob(
    s3_outage, s3_session_store
):
    # The blobs that landed are deleted with the failed attempt (nothing names them); with the
    # store gone that cleanup gives up at its first failed delete, leaving them to gc, instead
    # of waiting out the retry deadline once per blob (32 shards x 30 s: 16 minutes).
    retry = RetryPolicy(max_attempts=100, base_delay_s=0.05, max_delay_s=0.2, deadline_s=2.0)
    _, tl, rl = tiny_layouts(tp=4)
    shards = [s.id for s in rl.shards()]
    prefix = f"outage-{uuid.uuid4().hex[:8]}"
    store = S3Store(s3_session_store.bucket, prefix, config=s3_outage.config(retry=retry))
    down = _DownAtLastBlob(store, s3_outage, shards[-1], len(shards) - 1)
    cfg = PublisherConfig(upload_threads=len(shards))
    pub = Publisher(down, receiver_layout=rl, config=cfg)
    gen = torch.Generator().manual_seed(5)
    params = {n: torch.randn(s, generator=gen).bfloat16() for n, s in tl.param_shapes().items()}
    with pytest.raises(StoreError, match="EndpointConnectionError"):
        pub.publish(0, [], params, anchor=True)
    waited = time.monotonic() - down.down_at
    assert waited < 3 * retry.deadline_s + 1.0, f"{waited:.1f} s for {len(shards)} blobs"
    store.close()
