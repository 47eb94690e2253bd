"""A pull whose scatter ended but whose state file could not be written (disk full): the
receiver must not go on reporting the version before it, which the tensors no longer hold."""

from __future__ import annotations

from kit import anchored_bf16, assert_same_bits, publish_edit, rconfig, zero_tensors

from deltasync import MemoryStore, Receiver
from deltasync.errors import LocalStateError
from deltasync.receiver.journal import StateDir

SHARD = "tp0"


def test_a_failed_state_file_write_reports_no_version_until_the_journal_is_replayed(
    tmp_path, monkeypatch
):
    # It reported version 0, not dirty (so a vLLM worker's weight_version said 0) while its
    # tensors held version 1.
    store = MemoryStore()
    tl, rl, params, pub = anchored_bf16(store, seed=3)
    tensors = zero_tensors(rl, SHARD)
    rec = Receiver.for_layout(store, rl, SHARD, tensors, str(tmp_path / "rec"), rconfig("rec"))
    assert rec.pull().version == 0
    publish_edit(pub, params, 1, 7)
    v1 = rl.split(tl.to_canonical(params))[SHARD]

    def fails(self, state):
        raise LocalStateError(f"cannot write {str(self.path)!r}: No space left on device")

    with monkeypatch.context() as m:
        m.setattr(StateDir, "write_state", fails)
        try:
            rec.pull()
        except LocalStateError:
            pass
        else:
            raise AssertionError("the failed state file write did not raise")
    assert_same_bits(tensors, v1, "the scatter ended")
    assert rec.dirty, "tensors at version 1, recorded version 0: it must report no version"
    assert rec.version is None and rec.verified_version == 0  # the record moves with the file
    report = rec.pull()  # the journal is replayed
    assert report.repaired and report.version == 1 and not rec.dirty
    assert_same_bits(tensors, v1)
