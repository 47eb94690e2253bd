"""Round 1's row codec, config validation and payload normalisation: pure, no processes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltasync.errors import ConfigError, ExchangeError, PeerFailedError
from deltasync.exchange import ExchangeConfig
from deltasync.exchange.rounds import as_byte_tensors
from deltasync.exchange.status_row import (
    MESSAGE_BYTES,
    decode_rows,
    describe,
    encode_row,
    fit,
    row_length,
)


def rows_for(matrix, failures=None, settings=None, more=()):
    failures = failures or {}
    settings = settings or {}
    return torch.stack(
        [
            encode_row(
                row,
                failure=failures.get(r),
                max_chunk_bytes=settings.get(r, (1024, 8))[0],
                max_inflight_ops=settings.get(r, (1024, 8))[1],
                more=r in more,
            )
            for r, row in enumerate(matrix)
        ]
    )


def test_a_row_is_world_size_plus_a_fixed_number_of_int64s() -> None:
    row = encode_row([1, 2, 3], failure=None, max_chunk_bytes=10, max_inflight_ops=2)
    assert row.dtype == torch.int64
    assert row.shape == (row_length(3),) == (3 + 7 + MESSAGE_BYTES // 8,)


def test_gathered_rows_decode_to_the_byte_count_matrix() -> None:
    matrix = [[0, 5, 1 << 40], [7, 0, 0], [0, 0, 3]]
    assert decode_rows(rows_for(matrix)) == (tuple(tuple(r) for r in matrix), False)


def test_one_rank_with_more_to_send_makes_every_rank_see_that_another_exchange_follows() -> None:
    matrix = [[0, 5, 1], [7, 0, 0], [0, 0, 3]]
    for more in ({0}, {2}, {0, 1, 2}):
        assert decode_rows(rows_for(matrix, more=more)) == (tuple(map(tuple, matrix)), True)


def test_a_failure_is_raised_even_where_ranks_said_more_follows() -> None:
    rows = rows_for([[0, 1], [1, 0]], failures={1: "OSError: gone"}, more={0})
    with pytest.raises(PeerFailedError, match="rank 1 failed"):
        decode_rows(rows)


def test_a_failed_rank_makes_decoding_raise_peer_failed_naming_it_and_its_message() -> None:
    rows = rows_for([[0, 1], [1, 0]], failures={1: describe(ValueError("no grad for layer 3"))})
    with pytest.raises(PeerFailedError, match=r"rank 1 failed .*ValueError: no grad for layer 3"):
        decode_rows(rows)


def test_several_failed_ranks_are_all_named_in_one_message() -> None:
    rows = rows_for([[0] * 3] * 3, failures={0: "OSError: disk", 2: "KeyError: 'w'"})
    with pytest.raises(PeerFailedError) as info:
        decode_rows(rows)
    assert "ranks 0, 2" in str(info.value)
    assert "rank 0: OSError: disk" in str(info.value)
    assert "rank 2: KeyError: 'w'" in str(info.value)


def test_a_long_message_is_cut_at_a_character_boundary_within_the_fixed_field() -> None:
    text = "é" * 600  # 1200 bytes of UTF-8, two per character: more than the field holds
    rows = rows_for([[0, 0], [0, 0]], failures={0: text})
    with pytest.raises(PeerFailedError) as info:
        decode_rows(rows)
    assert "é" * (MESSAGE_BYTES // 2 - 4) + " [cut]" in str(info.value)
    assert "\ufffd" not in str(info.value)


def test_a_long_reason_is_cut_between_clauses_and_marked_never_mid_word() -> None:
    clauses = "; ".join(f"writer w{i:05d} lost its shard of layer {i}" for i in range(60))
    cut = fit(clauses).decode()
    assert len(cut.encode()) <= MESSAGE_BYTES and cut.endswith(" [cut]")
    assert cut.removesuffix(" [cut]").endswith(";")  # the last whole clause, then the mark
    assert fit("short").decode() == "short"


def test_a_failure_on_several_lines_keeps_every_line() -> None:
    assert describe(ValueError("first\nthe reason")) == "ValueError: first the reason"


def test_ranks_with_different_settings_raise_naming_every_ranks_settings() -> None:
    rows = rows_for([[0, 1], [1, 0]], settings={1: (2048, 8)})
    with pytest.raises(ExchangeError, match="rank 1: max_chunk_bytes=2048"):
        decode_rows(rows)


def test_a_row_that_is_not_an_exchange_row_is_refused() -> None:
    rows = rows_for([[0, 1], [1, 0]])
    rows[1, 0] = 12345
    with pytest.raises(ExchangeError, match=r"rank\(s\) 1 sent a row that is not"):
        decode_rows(rows)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_chunk_bytes": 0}, "max_chunk_bytes"),
        ({"max_chunk_bytes": 1.5}, "max_chunk_bytes"),
        ({"max_inflight_ops": 1}, "max_inflight_ops"),
        ({"max_inflight_ops": True}, "max_inflight_ops"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": float("inf")}, "timeout_s"),
    ],
)
def test_an_invalid_config_value_is_rejected_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ExchangeConfig(**kwargs)


def test_the_config_is_frozen_and_keyword_only() -> None:
    config = ExchangeConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.timeout_s = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        ExchangeConfig(1024)  # type: ignore[misc]


def test_payloads_of_every_accepted_type_become_flat_byte_views_without_copies() -> None:
    data = bytearray(b"abcdef")
    tensor = torch.arange(6, dtype=torch.uint8).reshape(2, 3)
    flat = as_byte_tensors(
        {0: b"xyz", 1: data, 2: memoryview(data)[2:], 3: tensor, 4: b""}, world_size=5
    )
    assert sorted(flat) == [0, 1, 2, 3]  # the empty payload is no payload
    assert bytes(flat[0].numpy()) == b"xyz"
    assert bytes(flat[2].numpy()) == b"cdef"
    data[0] = ord("Z")  # shared memory, not a copy
    assert bytes(flat[1].numpy()) == b"Zbcdef"
    assert flat[3].data_ptr() == tensor.data_ptr() and flat[3].shape == (6,)


@pytest.mark.parametrize(
    ("payloads", "words"),
    [
        ({0: torch.zeros(2, dtype=torch.float32)}, "float32"),
        ({0: torch.zeros(4, 4, dtype=torch.uint8).t()}, "not contiguous"),
        ({3: b"x"}, "key 3 is not a rank"),
        ({True: b"x"}, "key True"),
        ({0: "text"}, "is a str"),
    ],
)
def test_an_unusable_payload_is_refused_naming_its_destination(payloads: dict, words: str) -> None:
    with pytest.raises(ExchangeError, match=words):
        as_byte_tensors(payloads, world_size=3)
