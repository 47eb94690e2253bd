"""Children for the crash tests (run in forked processes, killed with SIGKILL) and the
oracle that replays any committed version from the store."""

from __future__ import annotations

import time

import torch

from deltasync import names
from deltasync.commit import Catalog
from deltasync.format import apply_updates, fold_chain
from deltasync.publish import Publisher, PublisherConfig, TrainerSync
from deltasync.receiver import Receiver, mapped_shard_tensors
from deltasync.receiver.staging import fetch_version
from deltasync.trainer import AdamWTracker

from sync_kit import GateStore, TinyTrainer, layouts, rconfig, scratch_store

FROZEN_S = 120  # a frozen child waits this long for its SIGKILL


def publisher_child(make_store, versions, kill_at, frozen, seed, anchor_every) -> None:
    """Train deterministically and publish ``versions`` versions; freeze at ``kill_at``
    ((op, key predicate)) after setting ``frozen``, to be killed there."""
    spec, _tl, rl = layouts()
    inner = make_store()

    def gate(op, key):
        if kill_at is not None and kill_at(op, key, inner):
            frozen.set()
            time.sleep(FROZEN_S)

    trainer = TinyTrainer(spec, seed=seed)
    pub = Publisher(
        GateStore(inner, gate),
        receiver_layout=rl,
        config=PublisherConfig(anchor_every=anchor_every),
    )
    sync = TrainerSync(AdamWTracker(trainer.opt, trainer.named_parameters()), pub, trainer.params)
    for v in range(versions):
        if v:
            trainer.step()
        sync.step_published(v)


def expected_states(versions: int, seed: int):
    spec, tl, rl = layouts()
    trainer = TinyTrainer(spec, seed=seed)
    from sync_kit import expected_shards

    out = {}
    for v in range(versions):
        if v:
            trainer.step()
        out[v] = expected_shards(trainer.params, tl, rl)
    return out


def replay_version(store, shard: str, version: int) -> dict[str, torch.Tensor]:
    """The state of ``shard`` at committed ``version``, rebuilt from the newest anchor at or
    before it, independently of any receiver."""
    _, _, rl = layouts()
    catalog = Catalog(store)
    specs = rl.local_specs(shard)
    steps = []
    for m in catalog.chain(None, version):
        steps.append((m.kind, fetch_version(store, m, shard, specs)[0]))
    tensors = {n: torch.zeros(s.shape, dtype=s.dtype) for n, s in specs.items()}
    apply_updates(fold_chain(steps, specs), tensors)
    return tensors


def receiver_child(store_path, shard, file, state_dir, stop_after, frozen) -> None:
    """Pull into the mapped tensors; freeze after writing ``stop_after`` tensors."""
    _, _, rl = layouts()
    written = []

    def on_tensor(name):
        written.append(name)
        if len(written) == stop_after:
            frozen.set()
            time.sleep(FROZEN_S)

    tensors = mapped_shard_tensors(file, rl.local_specs(shard))
    rec = Receiver.for_layout(
        scratch_store(store_path),
        rl,
        shard,
        tensors,
        str(state_dir),
        rconfig("victim"),
        on_tensor_written=on_tensor,
    )
    rec.pull()


def is_blob_of(version: int):
    prefix = names.version_prefix(version)
    return lambda key: key.startswith(prefix) and key.endswith(".blob")
