"""The preflight's rows and verdict (pure tables): fingerprints, versions and attempt windows
decide before any payload moves, with the same text on every rank."""

from __future__ import annotations

import pytest
import torch

from deltasync.cluster import RolePlan
from deltasync.cluster.preflight import (
    ARRIVED,
    PATIENCE,
    RECEIVER,
    ROW_LENGTH,
    UNKNOWN,
    WRITER,
    combined_window,
    decode_preflight_rows,
    encode_preflight_row,
    fingerprint,
    judge,
)
from deltasync.errors import (
    ExchangeTimeoutError,
    FingerprintMismatchError,
    PeerFailedError,
    SyncAbortedError,
)
from deltasync.exchange.status_row import CLOCK_SKEW_S
from deltasync.layout import ModelSpec, ReceiverLayout

CONFIG = dict(
    model_type="qwen3",
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=1000,
    tie_word_embeddings=False,
)
PLAN = RolePlan.contiguous(num_writers=2, shards=["tp0", "tp1"])  # ranks 0-1 write


def layout(**overrides) -> ReceiverLayout:
    return ReceiverLayout.build(ModelSpec.from_hf_config({**CONFIG, **overrides}), "vllm", tp=2)


GOOD = fingerprint(layout(), PLAN)


def writer(v=3, b=2, window=11, fp=GOOD, failure=None):
    return encode_preflight_row(
        role=WRITER,
        fingerprint=fp,
        who="writer",
        version=v,
        base=b,
        window=window,
        failure=failure,
    )


def receiver(committed=2, applying=None, window=0, dirty=False, fp=GOOD):
    return encode_preflight_row(
        role=RECEIVER,
        fingerprint=fp,
        who="receiver",
        version=committed,
        base=None if applying is None else applying[0],
        window=window,
        applying_base=None if applying is None else applying[1],
        dirty=dirty,
    )


def verdict(*rows):
    return judge(decode_preflight_rows(torch.stack(list(rows))), PLAN)


def test_ranks_that_agree_clear_the_version_with_the_writers_combined_window() -> None:
    cleared = verdict(writer(window=11), writer(window=12), receiver(), receiver())
    assert (cleared.version, cleared.base) == (3, 2)
    assert cleared.window == combined_window([11, 12]) != combined_window([11, 13])


def test_a_vocabulary_of_1010_padded_like_1000_has_another_fingerprint() -> None:
    odd = fingerprint(layout(vocab_size=1010), PLAN)
    assert layout(vocab_size=1010).local_specs("tp0") == layout().local_specs("tp0")
    with pytest.raises(FingerprintMismatchError, match=r"differ in model, layout") as info:
        verdict(writer(), writer(), receiver(), receiver(fp=odd))
    assert "rank 3: receiver: qwen3 V=1010" in str(info.value)
    assert "rank 0: writer: qwen3 V=1000" in str(info.value)


def test_a_receiver_built_to_verify_refuses_writers_that_send_no_digests() -> None:
    # The receivers' own digest_every had no effect: one writer built with digest_every=0
    # turned verification off on every receiver, and writers of two policies were refused at
    # staging on every version, after the bytes moved.
    none = fingerprint(layout(), PLAN, digest_every=0)
    with pytest.raises(FingerprintMismatchError, match=r"differ in plan\)") as info:
        verdict(writer(fp=none), writer(fp=none), receiver(), receiver())
    assert "digest policy (ClusterConfig.digest_every)" in str(info.value)
    assert "rank 0: writer: " in str(info.value) and "digests none" in str(info.value)
    assert "rank 2: receiver: " in str(info.value) and "digests every 1" in str(info.value)
    with pytest.raises(FingerprintMismatchError, match=r"differ in plan\)"):
        verdict(writer(fp=none), writer(), receiver(fp=none), receiver(fp=none))
    # one policy on every rank, verification off included, clears
    assert verdict(writer(fp=none), writer(fp=none), receiver(fp=none), receiver(fp=none))


def test_the_row_keeps_the_size_of_the_release_before() -> None:
    # A row of another size makes the preflight's all_gather a collective of two sizes: gloo
    # aborts the rank with the smaller buffer (SIGABRT) and the other decodes a shifted row.
    # Same-size rows of two releases are told apart by the magic or refused by fingerprint.
    # Growing the row needs a new magic and a note in docs/cluster.md; then update this size.
    assert ROW_LENGTH == 145


def test_a_rank_refused_for_a_version_no_int64_holds_still_reports_its_failure() -> None:
    # the row raised a bare OverflowError on the failing rank, which then never arrived: every
    # other rank waited out its timeout and was told nothing
    bad = writer(v=2**64, b=None, window=2**70, failure="ConfigError: version 2**64")
    assert decode_preflight_rows(bad[None])[0].version == UNKNOWN
    with pytest.raises(PeerFailedError, match=r"rank 1 failed before sending .*version 2\*\*64"):
        verdict(writer(), bad, receiver(), receiver())


def test_a_failed_writer_is_named_on_every_rank_before_anything_moves() -> None:
    with pytest.raises(
        PeerFailedError, match=r"rank 1 failed before sending \(rank 1: RuntimeError: x\)"
    ):
        verdict(writer(), writer(failure="RuntimeError: x"), receiver(), receiver())


@pytest.mark.parametrize(
    ("row", "why"),
    [
        (receiver(committed=None), "holds no verified version"),
        (receiver(dirty=True), "is dirty"),
        (receiver(committed=1), "holds version 1, not the base 2"),
        (receiver(applying=(3, 2), window=combined_window([99, 12])), "does not cover"),
    ],
)
def test_a_delta_some_receiver_cannot_take_is_refused_everywhere_asking_for_an_anchor(
    row, why: str
) -> None:
    with pytest.raises(SyncAbortedError, match=why) as info:
        verdict(writer(window=11), writer(window=12), receiver(), row)
    assert info.value.anchor_required and set(info.value.failures) == {3}


def test_an_attempt_of_the_same_window_is_covered_by_the_retry_and_an_anchor_by_anything() -> None:
    same = combined_window([11, 12])
    verdict(
        writer(window=11), writer(window=12), receiver(), receiver(applying=(3, 2), window=same)
    )
    verdict(writer(b=-1), writer(b=-1), receiver(committed=None), receiver(dirty=True))


def test_writers_sending_different_versions_are_refused() -> None:
    with pytest.raises(SyncAbortedError, match=r"different versions.*sync\(4, anchor=True\)"):
        verdict(writer(v=3), writer(v=4), receiver(), receiver())
    # a replaced writer counting from 0 beside one at 3, receivers at 5: above what they hold
    with pytest.raises(SyncAbortedError, match=r"sync\(6, anchor=True\)"):
        verdict(writer(v=0, b=-1), writer(v=3), receiver(committed=5), receiver(committed=5))


def _arrived(row: torch.Tensor, at_s: float, waits_s: float) -> torch.Tensor:
    """``row`` as preflight() stamps it: entered at ``at_s``, waiting ``waits_s`` there."""
    row = row.clone()
    row[ARRIVED], row[PATIENCE] = round(at_s * 1000), round(waits_s * 1000)
    return row


def test_a_rank_that_came_after_a_writer_stopped_waiting_is_named_on_every_rank() -> None:
    # The writers wait 4 s, the receivers 60: the all_gather still completes on the receivers
    # with the writers' rows after writer 0 gave up. Going on, they would time out in round 1
    # and blame the healthy writer; they refuse here, naming the late receiver.
    rows = [
        _arrived(writer(window=11), 100.0, 4),
        _arrived(writer(window=12), 100.2, 4),
        _arrived(receiver(), 100.1, 60),
        _arrived(receiver(), 106.0, 60),  # rank 3, 6 s after writer 0
    ]
    with pytest.raises(ExchangeTimeoutError, match=r"version 3: rank 3 \(receiver tp1") as err:
        verdict(*rows)
    assert "rank 0 (writer w00000) had stopped waiting (it waits 4 s there)" in str(err.value)
    # within the clocks' allowance nothing is refused: a preflight every rank completes
    rows[3] = _arrived(receiver(), 100.0 + 4 + CLOCK_SKEW_S * 0.9, 60)
    assert verdict(*rows).version == 3
