"""The S3 server goes away in the middle of a publish (the loopback moto server is stopped and
restarted on its port). A short outage is ridden out by the store's retries; one longer than
the retry deadline fails the publish cleanly (nothing visible, the tracker keeps its bits), and
the retry after the server is back converges bit-exactly."""

from __future__ import annotations

import threading
import uuid

import pytest

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
