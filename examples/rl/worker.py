"""A rollout worker process: pull deltas, prove the weights exact, generate, return trajectories.

The worker's engine starts with zero tensors; the only way weights get into it is
``Receiver.pull`` from the shared store (an anchor and the deltas after it). Per request:

1. pull every shard to the newest committed version, at least ``min_version`` (bounded
   staleness: the trainer asks for the oldest version it will still accept), and make all
   shards agree on one version (a commit may land between two shards' pulls);
2. the first time it holds a version, compute the probe batch's logits and compare their bits
   with the trainer's dense reference for that version (sent on the worker's pipe);
   any difference is reported and ends the worker;
3. sample completions with the engine and return them tagged with the version they came from.

The worker talks to the trainer over its own pipe. Trainer -> worker: ``("ref", version,
bits)``, ``("request", {...})``, ``("check", version)`` (pull to at least that version and run
the probe now, answered every time, also for a version already proven: used after a restart
and at the end, so every worker proves the final version), ``("stop",)``. Worker -> trainer: dicts with a ``kind``: ``ready``, ``probe``,
``trajectories``, ``error``. Tensors travel as numpy arrays. This module knows the worker's side of that protocol; the
trainer's side lives in :mod:`deltasync_examples.rl.fleet` and :mod:`deltasync_examples.rl.loop`.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass

import torch

from deltasync.errors import DeltaSyncError


class WorkerTimeoutError(DeltaSyncError):
    """A worker waited too long for a version or a reference; the message says which."""


@dataclass(frozen=True, kw_only=True)
class WorkerArgs:
    index: int
    incarnation: int
    store_root: str
    state_root: str
    engine: str
    tp: int
    hf_config: dict
    temperature: float
    seed: int
    timeout_s: float


class _Worker:
    def __init__(self, args: WorkerArgs, conn) -> None:
        from deltasync import LocalStore, Receiver, ReceiverConfig
        from deltasync_examples.rl.policy_engine import RolloutEngine
        from deltasync_examples.rl.sampling import probe_batch

        self.args, self.conn = args, conn
        self.engine = RolloutEngine(args.engine, args.hf_config, args.tp)
        store = LocalStore(args.store_root)
        # A fresh state dir per incarnation: a restarted process has fresh (empty) tensors, so
        # nothing a previous incarnation recorded about its tensors applies any more.
        self.receivers = {
            sid: Receiver.for_layout(
                store,
                self.engine.layout,
                sid,
                adapter.params(),
                os.path.join(args.state_root, f"w{args.index}-{args.incarnation}", sid),
                ReceiverConfig(receiver_id=f"rl-w{args.index}-{sid}"),
            )
            for sid, adapter in self.engine.shards().items()
        }
        self.probe = probe_batch(args.hf_config["vocab_size"])
        self.refs: dict[int, torch.Tensor] = {}
        self.checked: set[int] = set()
        self.inbox: list[tuple] = []  # requests and checks that arrived while waiting for a ref
        self.gen = torch.Generator().manual_seed(args.seed * 1000 + args.index)

    def held(self) -> int:
        versions = {
            -1 if r.version is None or r.dirty else r.version for r in self.receivers.values()
        }
        return versions.pop() if len(versions) == 1 else -1

    def sync(self, min_version: int) -> int:
        """Pull until every shard holds the same version >= ``min_version``; return it."""
        deadline = time.monotonic() + self.args.timeout_s
        while True:
            for rx in self.receivers.values():
                rx.pull()
            versions = [
                rx.version if rx.version is not None else -1 for rx in self.receivers.values()
            ]
            target = max(versions)
            for rx in self.receivers.values():  # a commit landed between two shards' pulls
                while (rx.version if rx.version is not None else -1) < target:
                    rx.pull()
            version = self.held()
            if version >= min_version:
                for sid, adapter in self.engine.shards().items():
                    adapter.version = self.receivers[sid].version
                return version
            if time.monotonic() > deadline:
                raise WorkerTimeoutError(
                    f"worker {self.args.index} waited {self.args.timeout_s}s for version "
                    f"{min_version}; it holds {version}"
                )
            time.sleep(0.005)

    def _recv(self, timeout: float) -> tuple | None:
        """The next message from the trainer; references are filed, not returned."""
        if not self.conn.poll(timeout):
            return None
        msg = self.conn.recv()
        if msg[0] == "ref":
            self.refs[msg[1]] = torch.from_numpy(msg[2])
            return ("ref",)
        return msg

    def check_probe(self, version: int, *, asked: bool = False) -> None:
        """Prove ``version`` (the one held) once, before generating from it; when the trainer
        ``asked`` (a ``check``), always: it waits for the answer, also for a version this
        worker proved already (a worker restarted at the last step proves it twice)."""
        from deltasync_examples.rl.sampling import logits_bits

        if version in self.checked and not asked:
            return
        deadline = time.monotonic() + self.args.timeout_s
        while version not in self.refs:
            msg = self._recv(max(deadline - time.monotonic(), 0.01))
            if msg is None:
                raise WorkerTimeoutError(
                    f"worker {self.args.index}: no reference logits for version {version}"
                )
            if msg[0] != "ref":
                self.inbox.append(msg)
        ours = logits_bits(self.engine.logits(self.probe))
        exact = bool(torch.equal(ours, self.refs[version]))
        self.checked.add(version)
        for v in [v for v in self.refs if v < version]:
            del self.refs[v]
        self.conn.send(
            {
                "kind": "probe",
                "worker": self.args.index,
                "version": version,
                "exact": exact,
                "incarnation": self.args.incarnation,
            }
        )
        if not exact:
            raise SystemExit(3)  # the trainer fails the run on the probe message

    def serve(self) -> None:
        from deltasync_examples.rl.sampling import generate

        self.conn.send(
            {
                "kind": "ready",
                "worker": self.args.index,
                "pid": os.getpid(),
                "incarnation": self.args.incarnation,
            }
        )
        while True:
            msg = self.inbox.pop(0) if self.inbox else self._recv(None)
            if msg[0] == "ref":
                continue
            if msg[0] == "stop":
                return
            if msg[0] == "check":  # prove exactness at >= this version now, without a request
                self.check_probe(self.sync(msg[1]), asked=True)
                continue
            req = msg[1]
            version = self.sync(req["min_version"])
            self.check_probe(version)
            answers, logprobs = generate(
                self.engine.logits,
                torch.from_numpy(req["prompts"]),
                req["gen_len"],
                temperature=self.args.temperature,
                generator=self.gen,
            )
            self.conn.send(
                {
                    "kind": "trajectories",
                    "worker": self.args.index,
                    "id": req["id"],
                    "version": version,
                    "answers": answers.numpy(),
                    "logprobs": logprobs.numpy(),
                }
            )


def worker_main(args: WorkerArgs, conn) -> None:
    """Process entry point (spawned by :class:`deltasync_examples.rl.fleet.Fleet`)."""
    torch.set_num_threads(1)  # same kernels and thread count as the trainer's reference
    try:
        _Worker(args, conn).serve()
    except SystemExit:
        raise
    except BaseException as exc:  # report, then die: the trainer decides what happens next
        try:
            conn.send(
                {
                    "kind": "error",
                    "worker": args.index,
                    "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc(),
                }
            )
        except OSError:  # the trainer closed the pipe or is gone: nobody is left to tell
            return
        raise
