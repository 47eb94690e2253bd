"""A multipart upload left open under a version (S3: a CreateMultipartUpload the server applied
after its call had ended, past put_stream's own sweep; or an abort that never got through)
is aborted when gc deletes that version, by ``Publisher.gc`` and ``deltasync gc`` alike: it
stayed open for good (nothing else ever lists it), until the bucket's lifecycle rules reaped
it. Uploads under versions gc keeps are left alone."""

from __future__ import annotations

from kit import anchored_bf16, publish_edit

from deltasync import names


def _open_uploads(store, under: str) -> list[str]:
    full = f"{store.prefix}/{under}"
    listed = store._client.list_multipart_uploads(Bucket=store.bucket, Prefix=full)
    return [u["Key"] for u in listed.get("Uploads", ())]


def _stray(store, key: str) -> None:
    # what a late-applied create leaves: an upload of the key nobody holds the id of
    store._client.create_multipart_upload(Bucket=store.bucket, Key=f"{store.prefix}/{key}")


def test_gc_aborts_uploads_left_open_under_the_versions_it_deletes(s3_store):
    _, _, params, pub = anchored_bf16(s3_store, seed=3)
    blob = next(k for k in s3_store.list(names.version_dir(0) + "/") if k.endswith(".blob"))
    _stray(s3_store, blob)  # beside the committed blob of version 0
    _stray(s3_store, names.blob_key(1, "tp0", "w-lost"))  # an attempt whose abort never landed
    for v in (1, 2, 3):
        publish_edit(pub, params, v, 5)
    pub.publish(4, [], params, anchor=True)
    _stray(s3_store, names.blob_key(4, "tp0", "w-late"))  # under the head: kept
    assert _open_uploads(s3_store, "v0000000")
    plan = pub.gc()
    assert 0 in plan.versions and 1 in plan.versions
    assert _open_uploads(s3_store, names.version_dir(0) + "/") == []
    assert _open_uploads(s3_store, names.version_dir(1) + "/") == []
    assert _open_uploads(s3_store, names.version_dir(4) + "/") == [
        f"{s3_store.prefix}/{names.blob_key(4, 'tp0', 'w-late')}"
    ]


def test_a_dry_run_aborts_nothing(s3_store):
    from deltasync.commit import Catalog, collect_garbage

    _, _, params, pub = anchored_bf16(s3_store, seed=4)
    _stray(s3_store, names.blob_key(0, "tp0", "w-lost"))
    publish_edit(pub, params, 1, 5)
    pub.publish(2, [], params, anchor=True)
    pub.publish(3, [], params, anchor=True)
    plan = collect_garbage(
        s3_store, Catalog(s3_store), keep_versions=1, receiver_ttl_s=60.0, dry_run=True
    )
    assert 0 in plan.versions
    assert len(_open_uploads(s3_store, names.version_dir(0) + "/")) == 1
