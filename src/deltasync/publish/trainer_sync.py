"""TrainerSync: detection -> publish -> clear, in the order that keeps every delta exact.

The tracker's baseline (``clear()``) may advance only after the version is committed on every
publisher (several publishers serve several receiver layouts, e.g. a vLLM TP=2 fleet and an
HF evaluator, each on its own store prefix). Until then the tracker keeps its bits, so a retry
resends everything since the last committed version; values are absolute overwrites, so
elements sent twice are harmless.

``synchronous=True`` also waits for the acknowledgements of the given receivers after each
commit (synchronous RL); the version stays committed if that wait times out.

This class knows the tracker protocol (:class:`deltasync.trainer.Tracker`: ``iter_changes()``
and ``clear()``) and Publisher; nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from deltasync.errors import ConfigError
from deltasync.publish.publisher import Publisher, PublishReport
from deltasync.trainer import Tracker

Params = Mapping[str, torch.Tensor]


class TrainerSync:
    """One tracker feeding one or more publishers.

    ``params`` are the named parameters the tracker watches (or a callable returning them);
    ``baseline`` is the committed version they equal when the tracker was created or last
    cleared, if the caller knows it (e.g. after loading the checkpoint of that version); None
    makes the first publish an anchor (a version already committed with the same state is
    recognised instead, see :meth:`Publisher.publish`)."""

    def __init__(
        self,
        tracker: Tracker,
        publishers: Publisher | Sequence[Publisher],
        params: Params | Callable[[], Params],
        *,
        baseline: int | None = None,
        full_state: Params | Callable[[], Params] | None = None,
        synchronous: bool = False,
        ack_receivers: Sequence[str] | None = None,
        ack_timeout_s: float = 60.0,
    ) -> None:
        pubs = [publishers] if isinstance(publishers, Publisher) else list(publishers)
        if not pubs:
            raise ConfigError("TrainerSync needs at least one publisher")
        self.tracker = tracker
        self.publishers = pubs
        self._params = params
        self._full_state = full_state
        self.baseline = baseline
        self.synchronous = synchronous
        self.ack_receivers = ack_receivers
        self.ack_timeout_s = ack_timeout_s

    def step_published(self, version: int, *, anchor: bool = False) -> list[PublishReport]:
        """Publish the changes since the baseline as ``version`` on every publisher, then
        clear the tracker. On any failure the tracker keeps its bits and the exception
        propagates: call again (same or a later version) to retry.

        Args:
            version: the version to commit on every publisher.
            anchor: publish a full version instead of the tracker's changes.

        Returns:
            One :class:`PublishReport` per publisher, in order.
        """
        params = self._params() if callable(self._params) else self._params
        changes: Iterable = self.tracker.iter_changes()
        if len(self.publishers) > 1:  # every publisher needs the same changes: detect once
            changes = list(changes)
        # With one publisher the stream is lazy: each group is detected while the previous
        # one is encoded and uploading.
        reports = [
            pub.publish(
                version, changes, params, anchor=anchor, since=self.baseline,
                full_state=self._full_state,
            )
            for pub in self.publishers
        ]
        # Committed everywhere: the new baseline is this version's state.
        self.tracker.clear()
        self.baseline = version
        if self.synchronous:
            for pub in self.publishers:
                pub.wait_for_acks(version, self.ack_receivers, timeout=self.ack_timeout_s)
        return reports
