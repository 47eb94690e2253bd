"""A seeded fuzz of a hostile shared store, through the public API.

A real publisher commits versions 0..2 of the tiny Qwen3 into a LocalStore and a receiver
acknowledges one; then, round after round, a copy of that store is mutated the way someone
else who can write the store directory could: bytes flipped, files truncated, extended,
replaced by 8 GiB sparse files, FIFOs, directories, links to ``/dev/zero`` or to files and
directories outside the store; JSON fields set to huge integers, negative numbers, floats,
unicode, NULs and trailing newlines; duplicate keys; replayed manifests; foreign files with odd
names; heartbeats dated far in the future. On each mutated store a fresh receiver pulls, a
publisher restarts, collects garbage and publishes an anchor, and every listed key is read
with a bound. The checks:

- only typed errors (``DeltaSyncError``) ever come out;
- nothing outside the store is read (no returned bytes hold the outside sentinel) or changed;
- a receiver that reports a version holds exactly that version's bits; one that fails holds
  its previous bits, or says it is dirty (never a silently partial write);
- memory stays bounded (peak RSS grows by far less than one 8 GiB sparse blob).

With a signing key the receiver may only ever report a version the publisher committed.
"""

from __future__ import annotations

import json
import os
import random
import re
import resource
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from kit import TinyTrainer, expected_shards, rconfig, same_bits, tiny_layouts, zero_tensors

from deltasync import (
    DeltaSyncError,
    LocalStore,
    Publisher,
    PublisherConfig,
    Receiver,
    ReceiverConfig,
    SnapshotTracker,
    TrainerSync,
)
from deltasync.commit import Catalog

SEED = 1818
KEY = b"fuzz-signing-key-0123456789abcdef"
SECRET = b"OUTSIDE-SECRET"
HUGE = "9" * 309  # a 309-digit integer: float() of it overflows
ODD_STRINGS = ["\x00", "w00000\n", "é\u202e", "a" * 300, "../../x", "", " ", "v00000001"]


class World:
    """The pristine store (as files), the states each version left, and the layouts."""

    def __init__(self, base: Path, key: bytes | None) -> None:
        self.key = key
        self.spec, self.tl, self.rl = tiny_layouts()
        root = base / "pristine"
        store = LocalStore(root, durable=False)
        self.trainer = TinyTrainer(self.spec, density=0.2)
        pub = Publisher(
            store,
            receiver_layout=self.rl,
            config=PublisherConfig(anchor_every=100, signing_key=key),
        )
        sync = TrainerSync(
            SnapshotTracker(self.trainer.named_parameters()), pub, self.trainer.params
        )
        self.states = {}
        for v in range(3):
            if v:
                self.trainer.step()
            sync.step_published(v)
            self.states[v] = expected_shards(self.trainer.params, self.tl, self.rl)
        pub.close()
        rec = Receiver.for_layout(
            store, self.rl, "tp0", self.zeros("tp0"), str(base / "rs"), self.rconfig("r0")
        )
        rec.pull()
        self.files = {
            p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".")
        }

    def zeros(self, shard: str) -> dict[str, torch.Tensor]:
        return zero_tensors(self.rl, shard)

    def rconfig(self, rid: str) -> ReceiverConfig:
        return rconfig(rid, signing_key=self.key)

    def materialize(self, where: Path) -> tuple[Path, Path]:
        root, outside = where / "store", where / "outside"
        for rel, data in self.files.items():
            p = root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        (outside / "sub").mkdir(parents=True)
        (outside / "precious.json").write_bytes(SECRET)
        (outside / "sub" / "w00000.blob").write_bytes(SECRET + b"-blob")
        return root, outside


def _tree(path: Path) -> dict[str, bytes | None]:
    """Every entry below ``path``: a file's bytes, None for a directory."""
    return {
        str(p.relative_to(path)): None if p.is_dir() else p.read_bytes()
        for p in sorted(path.rglob("*"))
    }


# --- mutations: each takes (rng, store root, outside dir) and says what it did --------------


def _files(root: Path, suffix: str = "") -> list[Path]:
    return [
        p
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink() and p.name.endswith(suffix)
    ]


def _dirs(root: Path) -> list[Path]:
    return [p for p in sorted(root.rglob("*")) if p.is_dir() and not p.is_symlink()]


def _replace(path: Path, make: Callable[[Path], None]) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
    make(path)


def m_flip(rng, root, outside):
    p = rng.choice(_files(root))
    data = bytearray(p.read_bytes())
    if data:
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    p.write_bytes(bytes(data))
    return f"flip {p.name}"


def m_truncate(rng, root, outside):
    p = rng.choice(_files(root))
    os.truncate(p, rng.randrange(max(1, p.stat().st_size)))
    return f"truncate {p.name}"


def m_extend(rng, root, outside):
    p = rng.choice(_files(root))
    with open(p, "ab") as f:
        f.write(rng.randbytes(rng.randint(1, 64)))
    return f"extend {p.name}"


def m_sparse(rng, root, outside):
    p = rng.choice(_files(root))
    os.truncate(p, 8 * 2**30)
    return f"sparse 8 GiB {p.name}"


def m_link_outside(rng, root, outside):
    p = rng.choice(_files(root))
    _replace(p, lambda q: os.symlink(outside / "precious.json", q))
    return f"link {p.name} -> outside"


def m_dev_zero(rng, root, outside):
    p = rng.choice(_files(root))
    _replace(p, lambda q: os.symlink("/dev/zero", q))
    return f"link {p.name} -> /dev/zero"


def m_fifo(rng, root, outside):
    p = rng.choice(_files(root))
    _replace(p, os.mkfifo)
    return f"fifo {p.name}"


def m_dir_in_place(rng, root, outside):
    p = rng.choice(_files(root))
    _replace(p, lambda q: (q.mkdir(), (q / "x.json").write_bytes(b"{}")))
    return f"directory in place of {p.name}"


def m_link_dir(rng, root, outside):
    d = rng.choice([*_dirs(root), root / "acks" / "v00000000", root / "v00000003"])
    if d.exists() or d.is_symlink():
        _replace(d, lambda q: os.symlink(outside, q))
    else:
        d.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(outside, d)
    return f"link dir {d.relative_to(root)} -> outside"


def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    yield path


def m_json(rng, root, outside):
    candidates = [p for p in _files(root) if p.suffix == ".json" or p.name == "LATEST"]
    p = rng.choice(candidates)
    try:
        obj = json.loads(p.read_bytes())
    except ValueError:
        return m_flip(rng, root, outside)
    path = rng.choice(list(_leaves(obj)))
    kind = rng.choice(
        ["huge", "huge-neg", "neg", "float", "bool", "null", "string", "newline", "nest", "future"]
    )
    values = {
        "huge": "@HUGE@",
        "huge-neg": "@NHUGE@",
        "neg": -1,
        "float": 1e308,
        "bool": True,
        "null": None,
        "string": rng.choice(ODD_STRINGS),
        "nest": [[[[[[[[[[[[[[[[{}]]]]]]]]]]]]]]]],
        "future": time.time() + 1e9,
        "newline": "@NEWLINE@",
    }
    value = values[kind]
    if not path:
        obj = value
    else:
        target = obj
        for step in path[:-1]:
            target = target[step]
        target[path[-1]] = value
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    text = text.replace('"@HUGE@"', HUGE).replace('"@NHUGE@"', "-" + HUGE)
    text = text.replace("@NEWLINE@", "w00000\\n")
    if rng.random() < 0.2 and text.startswith("{") and len(text) > 2:
        text = '{"version":1,' + text[1:]  # a duplicate key (or an unknown one)
    p.write_text(text)
    return f"json {p.name} {list(path)} := {kind}"


def m_huge_number(rng, root, outside):
    """A 309-digit integer (or its negative) in place of a numeric field of a manifest or
    record: ``float()`` of it overflows, which once crashed every reader."""
    candidates = [p for p in _files(root) if p.suffix == ".json" or p.name == "LATEST"]
    manifests = [p for p in candidates if p.name == "MANIFEST.json"]
    p = rng.choice(manifests if manifests and rng.random() < 0.6 else candidates)
    text = p.read_text(errors="replace")
    numbers = list(re.finditer(r'"(\w+)":(-?[0-9][0-9.e+-]*)', text))
    times = [m for m in numbers if m.group(1).endswith(("_at", "_s"))]
    if not numbers:
        return m_json(rng, root, outside)
    # Times are where a float conversion happens: aim there more often than not.
    m = rng.choice(times if times and rng.random() < 0.7 else numbers)
    huge = rng.choice([HUGE, HUGE, "-" + HUGE, "1e400", "9" * 5000])
    p.write_text(text[: m.start(2)] + huge + text[m.end(2) :])
    return f"huge number in {p.name}"


def m_replay_manifest(rng, root, outside):
    manifests = sorted(root.glob("v*/MANIFEST.json"))
    a, b = rng.sample(manifests, 2)
    b.write_bytes(a.read_bytes())
    return f"replay {a.parent.name} manifest as {b.parent.name}"


def m_foreign(rng, root, outside):
    name = rng.choice(["notes\n.txt", "ünïcode.json", "x" * 255, "r\x01.json", "w00000.blob "])
    where = rng.choice(
        [
            root / "receivers",
            root / "v00000001",
            root / "acks" / "v00000001",
            root / "v00000002" / "tp0",
        ]
    )
    where.mkdir(parents=True, exist_ok=True)
    (where / name).write_bytes(b'{"version":' + HUGE.encode() + b"}")
    return f"foreign file {name!r} in {where.relative_to(root)}"


def m_future_heartbeat(rng, root, outside):
    (root / "receivers").mkdir(exist_ok=True)
    (root / "receivers" / "ghost.json").write_text(
        json.dumps(
            {"receiver": "ghost", "shard": "tp0", "version": 0, "updated_at": time.time() + 3e8}
        )
    )
    return "future heartbeat"


def m_delete(rng, root, outside):
    p = rng.choice(_files(root))
    p.unlink()
    return f"delete {p.name}"


MUTATIONS = [
    m_flip,
    m_truncate,
    m_extend,
    m_sparse,
    m_link_outside,
    m_dev_zero,
    m_fifo,
    m_dir_in_place,
    m_link_dir,
    m_json,
    m_json,
    m_huge_number,
    m_huge_number,
    m_replay_manifest,
    m_foreign,
    m_future_heartbeat,
    m_delete,
]


# --- what the public API does on a mutated store --------------------------------------------


def _typed(what: str, fn: Callable[[], object], log: list[str]) -> object:
    try:
        return fn()
    except DeltaSyncError as exc:
        log.append(f"{what}: {type(exc).__name__}")
        return None
    except Exception as exc:  # the failure this test exists to find
        raise AssertionError(f"{what} raised untyped {type(exc).__name__}: {exc}") from exc


def _exercise(world: World, root: Path, scratch: Path, rng: random.Random) -> list[str]:
    log: list[str] = []
    store = LocalStore(root, durable=False)
    shard = rng.choice(["tp0", "tp1"])
    tensors = world.zeros(shard)

    def pull():
        rec = Receiver.for_layout(
            store, world.rl, shard, tensors, str(scratch / "state"), world.rconfig("fuzz")
        )
        try:
            report = rec.pull()
        except DeltaSyncError:
            untouched = all(not t.view(torch.int16).any() for t in tensors.values())
            assert untouched or rec.dirty, "a failed pull left written tensors and a clean state"
            raise
        if report.version is not None:
            assert report.version in world.states, f"reported unknown version {report.version}"
            assert same_bits(tensors, world.states[report.version][shard]), (
                f"reported version {report.version} without holding its bits"
            )
        return report

    _typed("receiver pull", pull, log)

    def publisher_side():
        pub = Publisher(
            store,
            receiver_layout=world.rl,
            config=PublisherConfig(anchor_every=100, signing_key=world.key, marker_timeout_s=0.2),
        )
        try:
            _typed("committed", pub.committed, log)
            _typed("live receivers", pub.live_receivers, log)
            _typed("gc", pub.gc, log)
            if rng.random() < 0.3:
                _typed(
                    "anchor publish",
                    lambda: pub.publish(3, [], world.trainer.params, anchor=True),
                    log,
                )
        finally:
            pub.close()

    _typed("publisher", publisher_side, log)
    catalog = Catalog(store, signing_key=world.key)
    _typed("versions", catalog.versions, log)
    _typed("receivers", catalog.receivers, log)
    for v in range(4):
        _typed(f"acks {v}", lambda v=v: catalog.acks(v), log)

    def read_all():
        for key in store.list():
            try:
                data = store.get(key, max_bytes=1 << 20)
            except DeltaSyncError:
                continue
            assert SECRET not in data, f"read the outside sentinel through {key!r}"

    _typed("read every key", read_all, log)
    return log


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _fuzz(tmp_path: Path, *, key: bytes | None, rounds: int, seed: int) -> None:
    world = World(tmp_path, key)
    rng = random.Random(seed)
    rss0 = _peak_rss_mib()
    for i in range(rounds):
        where = tmp_path / f"round{i}"
        root, outside = world.materialize(where)
        before = _tree(outside)
        done = [rng.choice(MUTATIONS)(rng, root, outside) for _ in range(rng.randint(1, 3))]
        try:
            _exercise(world, root, where, rng)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed} round {i} after {done}: {exc}") from exc
        assert _tree(outside) == before, f"seed {seed} round {i} after {done}: outside changed"
        shutil.rmtree(where, ignore_errors=True)
    grown = _peak_rss_mib() - rss0
    assert grown < 512, f"peak RSS grew by {grown:.0f} MiB: a read was not bounded"


@pytest.mark.timeout(120)
def test_a_mutated_unsigned_store_yields_only_typed_errors_and_never_escapes_its_root(tmp_path):
    _fuzz(tmp_path, key=None, rounds=90, seed=SEED)


@pytest.mark.timeout(120)
def test_a_mutated_signed_store_never_makes_a_receiver_report_a_version_it_does_not_hold(
    tmp_path,
):
    _fuzz(tmp_path, key=KEY, rounds=45, seed=SEED + 1)


HOSTILE_KEY_PARTS = [
    "..",
    ".",
    "",
    ".tmp-x",
    "a\x00b",
    "a\nb",
    "\x7f",
    "é" * 128,
    "x" * 256,
    "\udc80",
    "a\\b",
    "/",
    "v00000001",
    "MANIFEST.json",
    "ok",
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["local", "memory"])
def test_random_hostile_keys_through_every_store_call_give_only_store_errors(tmp_path, backend):
    from deltasync import MemoryStore
    from deltasync.errors import StoreError

    rng = random.Random(SEED)
    store = LocalStore(tmp_path / "store", durable=False) if backend == "local" else MemoryStore()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(SECRET)
    calls = [
        lambda k: store.put(k, b"x"),
        lambda k: store.put_if_absent(k, b"x"),
        lambda k: store.put_stream(k, [b"x", b"y"]),
        lambda k: store.get(k, max_bytes=rng.choice([None, 0, 1, 10])),
        lambda k: store.get_range(k, rng.randrange(3), rng.randrange(3)),
        store.exists,
        store.size,
        store.delete,
        store.list,
    ]
    written = set()
    for _ in range(600):
        key = "/".join(rng.choice(HOSTILE_KEY_PARTS) for _ in range(rng.randint(1, 4)))
        call = rng.choice(calls)
        try:
            result = call(key)
        except StoreError:
            continue
        except Exception as exc:
            raise AssertionError(f"{key!r}: untyped {type(exc).__name__}: {exc}") from exc
        if call in calls[:3]:
            written.add(key)
        assert not isinstance(result, bytes) or SECRET not in result
    assert _tree(outside) == {"precious": SECRET}
    listed = set(store.list())
    for key in written:  # whatever was accepted is an ordinary key: listed while it exists
        assert key in listed or not store.exists(key)
