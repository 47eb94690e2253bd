"""A receiver that registers only once a version is confirmed (``register=False``: the
``deltasync pull`` sidecar) restoring its first anchor from S3 (the loopback moto server)
while the trainer anchors again and runs gc: its registration names the anchor it restores,
so gc keeps it (a registration naming nothing would let a gc pass beside the sidecar's first
restore delete the anchor under it: MissingBlobError). A restore that fails takes that
registration back."""

from __future__ import annotations

import pytest
from kit import (
    anchored_bf16,
    assert_same_bits,
    expected_shards,
    one_torch_thread,  # noqa: F401 - a fixture: pytest finds it by name here
    publish_edit,
    rconfig,
    zero_tensors,
)

from deltasync import Receiver
from deltasync.commit import Catalog
from deltasync.errors import MissingBlobError
from deltasync.store import S3Store

SHARD = "tp0"


def _sidecar(s3_server, s3_store, tmp_path, rl):
    """A register=False receiver on its own client, so that a hook on its reads fires for
    its reads alone."""
    reader = S3Store(s3_store.bucket, s3_store.prefix, config=s3_server.config())
    rx = Receiver.for_layout(
        reader,
        rl,
        SHARD,
        zero_tensors(rl, SHARD),
        str(tmp_path / "rx"),
        rconfig("side"),
        register=False,
    )
    return reader, rx


def _on_first_blob_read(reader: S3Store, action) -> list[str]:
    """Run ``action(full_key)`` once, just before the receiver's first blob GET is sent."""
    fired: list[str] = []

    def hook(params, **_):
        if not fired and params["Key"].endswith(".blob"):
            fired.append(params["Key"])
            action(params["Key"])

    reader._client.meta.events.register("before-parameter-build.s3.GetObject", hook)
    return fired


def test_an_unconfirmed_receivers_first_restore_keeps_its_anchor_through_gc(
    s3_server, s3_store, tmp_path
) -> None:
    tl, rl, params, pub = anchored_bf16(s3_store, seed=5)
    anchor0 = expected_shards(params, tl, rl)[SHARD]
    reader, rx = _sidecar(s3_server, s3_store, tmp_path, rl)
    during = {}

    def trainer(_key: str) -> None:  # anchors past version 0 and collects while it is fetched
        during["record"] = Catalog(s3_store).receiver("side")
        publish_edit(pub, params, 1, 5)
        pub.publish(2, [], params, anchor=True)
        pub.gc()

    fired = _on_first_blob_read(reader, trainer)
    report = rx.pull()
    assert fired and report.version == 0 and report.from_anchor
    assert_same_bits(rx.tensors, anchor0, "the anchor restored")
    record = during["record"]
    assert record is not None and record.restoring == 0 and record.version is None
    assert rx.pull().version == 2
    assert_same_bits(rx.tensors, expected_shards(params, tl, rl)[SHARD], "version 2")
    assert Catalog(s3_store).receiver("side").version == 2
    reader.close()


def test_an_unconfirmed_receivers_failed_restore_takes_its_registration_back(
    s3_server, s3_store, tmp_path
) -> None:
    _, rl, _, _ = anchored_bf16(s3_store, seed=6)
    reader, rx = _sidecar(s3_server, s3_store, tmp_path, rl)
    during = {}

    def vanish(key: str) -> None:  # the blob is deleted behind everyone's back
        during["record"] = Catalog(s3_store).receiver("side")
        reader._client.delete_object(Bucket=reader.bucket, Key=key)

    _on_first_blob_read(reader, vanish)
    with pytest.raises(MissingBlobError, match="v00000000"):
        rx.pull()
    assert during["record"] is not None and during["record"].restoring == 0
    assert Catalog(s3_store).receiver("side") is None  # nothing left naming the anchor
    assert rx.version is None
    reader.close()
