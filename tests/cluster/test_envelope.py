"""The envelope: framing of blobs (and forwarded envelopes) in one exchange payload."""

from __future__ import annotations

import pytest
import torch

from deltasync.cluster import EnvelopeError
from deltasync.cluster.envelope import (
    envelope_header,
    flatten,
    framed_first,
    header_size,
    join_parts,
    pack_envelope,
    seal_envelope,
    unpack_envelope,
)

DIGEST = "00112233445566778899aabbccddeeff"


def test_packing_then_unpacking_gives_back_the_parts_and_the_digest() -> None:
    parts = [b"first blob", b"", bytes(range(256)) * 3]
    data = pack_envelope(parts, state_digest=DIGEST)
    env = unpack_envelope(data, where="test")
    assert [bytes(p) for p in env.parts] == parts
    assert env.state_digest == DIGEST
    assert not env.nested
    # The exchange hands payloads over as uint8 tensors: same result, no copy of the parts.
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    assert [bytes(p) for p in unpack_envelope(tensor, where="t").parts] == parts


def test_a_forwarded_bundle_flattens_to_every_blob_and_digest_inside() -> None:
    a = pack_envelope([b"blob of writer 0"], state_digest=DIGEST)
    b = pack_envelope([b"blob of writer 1"])
    c = pack_envelope([b"blob of writer 2"], state_digest=DIGEST, part_digest=True)
    items = flatten(pack_envelope([a, b, c], nested=True), where="test")
    assert [(bytes(x), d, part) for x, d, part in items] == [
        (b"blob of writer 0", DIGEST, False),
        (b"blob of writer 1", None, False),
        (b"blob of writer 2", DIGEST, True),  # a writer's part digest stays with its blob
    ]


def test_an_envelope_without_a_digest_says_so() -> None:
    assert unpack_envelope(pack_envelope([b"x"]), where="t").state_digest is None


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda d: d[:10], "shorter than an envelope header"),
        (lambda d: b"NOTENVEL" + d[8:], "not a deltasync envelope"),
        (lambda d: d[:8] + b"\x03" + d[9:], "header check failed"),  # count 2 -> 3
        (lambda d: d[:12] + b"\x08" + d[13:], "unknown flags"),
        (lambda d: d[:-1], "follow the header"),
        (lambda d: d + b"\0", "follow the header"),
        (lambda d: d[:36] + bytes([d[36] ^ 1]) + d[37:], "header check failed"),  # a length
    ],
)
def test_a_damaged_envelope_is_refused_naming_what_is_wrong(damage, match: str) -> None:
    data = pack_envelope([b"abc", b"defgh"], state_digest=DIGEST)
    with pytest.raises(EnvelopeError, match=match):
        unpack_envelope(damage(data), where="payload from rank 3")


@pytest.mark.parametrize("payload", ["not a payload", None, 12, [1, 2]])
def test_a_payload_that_is_not_bytes_is_an_envelope_error(payload) -> None:
    # a bare TypeError from memoryview
    with pytest.raises(EnvelopeError, match="must be bytes or a 1-D uint8 tensor"):
        unpack_envelope(payload, where="payload from rank 0")


def test_a_strided_payload_tensor_reads_as_its_bytes() -> None:
    packed = pack_envelope([b"ab", b"cde"], state_digest=DIGEST)
    flat = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
    strided = torch.stack([flat, torch.zeros_like(flat)], 1)[:, 0]
    assert not strided.is_contiguous()
    got = unpack_envelope(strided, where="p")
    assert [bytes(p) for p in got.parts] == [b"ab", b"cde"] and got.state_digest == DIGEST


def test_a_bundle_forwarded_twice_is_refused() -> None:
    inner = pack_envelope([pack_envelope([b"x"])], nested=True)
    with pytest.raises(EnvelopeError, match="nested twice"):
        flatten(pack_envelope([inner], nested=True), where="t")


def test_a_digest_that_is_not_32_hex_characters_cannot_be_packed() -> None:
    with pytest.raises(EnvelopeError, match="32 hex"):
        pack_envelope([b"x"], state_digest="abc")


def test_the_envelope_bytes_are_pinned() -> None:
    # magic | count=2 | flags=digest | digest | lengths 2, 1 | xxh3-64 of all that | "ab" "c"
    assert pack_envelope([b"ab", b"c"], state_digest=DIGEST).hex() == (
        "445343454e563031"
        "02000000"
        "01000000"
        "00112233445566778899aabbccddeeff"
        "0200000000000000"
        "0100000000000000"
        "dc4860937d56ab62"
        "616263"
    )


def test_a_part_given_as_its_pieces_packs_to_the_same_bytes_as_the_joined_part() -> None:
    pieces = [b"head", b"", b"segment one", bytearray(b"segment two"), b"trailer"]
    joined = b"".join(pieces)
    for digest in (None, "ab" * 16):
        assert pack_envelope([pieces, b"other"], state_digest=digest) == pack_envelope(
            [joined, b"other"], state_digest=digest
        )
    env = unpack_envelope(pack_envelope([tuple(pieces)]), where="test")
    assert [bytes(p) for p in env.parts] == [joined]


def test_an_envelope_sealed_in_place_equals_the_packed_one() -> None:
    blob = bytes(range(256)) * 9
    for digest, part in ((None, False), (DIGEST, False), (DIGEST, True)):
        buf = bytearray(header_size(1)) + blob
        sealed = seal_envelope(buf, state_digest=digest, part_digest=part)
        assert sealed is buf  # framed where it lies: no second copy of the blob
        assert bytes(sealed) == pack_envelope([blob], state_digest=digest, part_digest=part)
        env = unpack_envelope(sealed, where="test")
        assert [bytes(p) for p in env.parts] == [blob] and env.part == part
    with pytest.raises(EnvelopeError, match="framing"):
        seal_envelope(bytearray(header_size(1) - 1))


BLOB = b"DSYB" + bytes(range(256)) * 40  # a blob starts with its own magic


def _cut(data: bytes, sizes: list[int]) -> list[torch.Tensor]:
    out, at = [], 0
    for n in sizes:
        out.append(torch.frombuffer(bytearray(data[at : at + n]), dtype=torch.uint8))
        at += n
    assert at == len(data)
    return out


@pytest.mark.parametrize(
    "sizes",
    [[len(BLOB) + 48], [5000, len(BLOB) + 48 - 5000], [3, 4000, 6000, len(BLOB) + 48 - 10003]],
)
def test_an_envelope_streamed_framing_last_joins_into_the_framed_first_envelope(sizes) -> None:
    framing = envelope_header([len(BLOB)], state_digest=DIGEST, part_digest=True)
    assert len(framing) == header_size(1) == 48
    streamed = BLOB + framing  # the blob's bytes as written, then its framing
    assert not framed_first(torch.frombuffer(bytearray(streamed), dtype=torch.uint8))
    joined = join_parts(_cut(streamed, sizes))  # the last cut splits the framing
    assert bytes(joined.numpy()) == pack_envelope([BLOB], state_digest=DIGEST, part_digest=True)
    env = unpack_envelope(joined, where="test")
    assert [bytes(p) for p in env.parts] == [BLOB] and env.state_digest == DIGEST and env.part


def test_an_envelope_sent_framing_first_in_parts_joins_unchanged() -> None:
    data = pack_envelope([BLOB], state_digest=DIGEST)
    assert framed_first(data)
    assert bytes(join_parts(_cut(data, [7, 100, len(data) - 107])).numpy()) == data


def test_a_streamed_payload_damaged_or_cut_short_is_refused_after_joining() -> None:
    framing = envelope_header([len(BLOB)], state_digest=DIGEST)
    damaged = bytearray(BLOB + framing)
    damaged[-3] ^= 1  # inside the framing's check
    with pytest.raises(EnvelopeError, match="damaged in transit"):
        unpack_envelope(join_parts(_cut(bytes(damaged), [1000, len(damaged) - 1000])), where="t")
    lost = BLOB[:-10] + framing  # a part went missing: the lengths do not add up
    with pytest.raises(EnvelopeError, match="declare"):
        unpack_envelope(join_parts(_cut(lost, [len(lost)])), where="t")
    with pytest.raises(EnvelopeError, match="cannot hold a 48-byte framing"):
        join_parts(_cut(b"DSYB" + bytes(10), [14]))
