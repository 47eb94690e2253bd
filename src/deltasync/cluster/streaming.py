"""A version's blobs streamed to the receivers over several exchanges while they are built.

Without streaming, an overlapped writer holds every receiver shard's whole compressed blob
until the exchange: every rank must know every size before it waits (the two-round exchange),
and a blob's size is known only once the last parameter is routed. Streaming keeps that rule
and cuts the version into parts: each part is one two-round exchange of the bytes the blobs
gained since the last part, and round 1 says whether more follows
(``exchange(..., more=True)``), so every rank agrees on when the version's bytes end. What a
writer holds is the part being built and the parts the receivers have not taken yet, instead
of the whole payload.

Writer (:class:`PartStream`): the builder (``capture.streamed_blobs``) offers its buffers after
every batch; once they hold ``part_bytes`` the bytes are taken (the buffers replaced by empty
ones) and queued for the stream's own thread, which runs the preflight before the first
exchange (so the routing never waits for the receivers to arrive: until they do, the parts
wait in memory, as the whole blobs did before) and then one exchange per part. The last part
carries what is left of each blob and then its envelope's framing (framing last, see
``envelope``): the framing holds the state digest, computed beside the routing, and the
blob's length. A writer whose build fails after the preflight sends its failure as the next
exchange's status: every rank raises the same PeerFailedError, as from the preflight, and
nothing is applied anywhere (receivers only stage at the end). A writer done before the others
takes part in their remaining exchanges with nothing to send.

Receiver (:func:`receive_parts`): exchanges while any rank says more follows; then
(:func:`join_payloads`, apart, so a payload that cannot be read still leaves the receiver in
step with every exchange and its joint commit) joins each source's parts into one payload,
framing in front (``envelope.join_parts``); a payload that came in one exchange framing first
(a writer that did not stream) is used as it arrived.

Exchange ``k`` of a version is tagged ``part_tag(tag, k)`` on every rank (the first keeps the
unstreamed exchange's tag). This module knows exchanges, threads and byte buffers; nothing
about routing, tensors' meaning or commits.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from deltasync.cluster.envelope import framed_first, join_parts
from deltasync.cluster.staging import as_cpu_bytes
from deltasync.errors import EnvelopeError, ExchangeError
from deltasync.exchange import ExchangeConfig, exchange
from deltasync.exchange.notes import part_tag
from deltasync.native.loader import HeapRelease

JOIN_RELEASE_BYTES = 8 << 20  # copied between two releases of the parts' freed pages


@dataclass(frozen=True)
class _Part:
    blobs: dict[str, bytearray]
    last: bool


@dataclass(frozen=True)
class _Failed:
    error: BaseException


class PartStream:
    """One writer's version on its way out in parts (see the module docstring).

    first_hop: ``{receiver rank: shard}`` the writer sends to (``RolePlan.first_hop()``).
    start: runs the preflight with this writer's failure (None: none) on the stream's thread
        and returns the version's exchange tag (then :attr:`tag`); it raises when any rank
        failed.
    part_bytes: the blobs' bytes that make a part (``ClusterConfig.part_bytes``).
    """

    def __init__(
        self,
        *,
        shards: list[str],
        first_hop: Mapping[int, str],
        start: Callable[[BaseException | None], str],
        group: dist.ProcessGroup | None,
        config: ExchangeConfig,
        part_bytes: int,
        name: str = "ds-parts",
    ) -> None:
        self._first_hop = dict(first_hop)
        self._start = start
        self._group, self._config = group, config
        self.part_bytes = part_bytes
        self.blob_bytes = dict.fromkeys(shards, 0)  # each shard's blob bytes taken so far
        self.bytes_sent = 0  # to other ranks, every part
        self.exchanges = 0
        self.error: BaseException | None = None
        self.tag: str | None = None  # the version's exchange tag, once the preflight passed
        self._last: _Part | None = None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def offer(self, blobs: dict[str, bytearray]) -> None:
        """After a batch: once ``blobs`` hold ``part_bytes``, take their bytes as the next part
        (each buffer replaced by an empty one). Raises the stream's error once it has failed
        (a peer refused or died): the build stops there."""
        if self.error is not None:
            raise self.error
        if sum(len(b) for b in blobs.values()) >= self.part_bytes:
            self._queue.put(_Part(self._take(blobs), last=False))

    def seal(
        self, blobs: dict[str, bytearray], framing: Callable[[str, int], bytes]
    ) -> dict[str, int]:
        """The last part, not sent yet: what is left of every blob (the builder is done),
        then its envelope's framing (``framing(shard, blob length)``). Returns each shard's
        blob length."""
        rest = self._take(blobs)
        for shard, n in self.blob_bytes.items():
            buf = rest.setdefault(shard, bytearray())
            buf += framing(shard, n)
        self._last = _Part(rest, last=True)
        return dict(self.blob_bytes)

    def finish(self) -> None:
        """Send the sealed last part and wait until every rank has ended the version's
        exchanges."""
        last, self._last = self._last, None
        if last is None:
            raise ExchangeError("PartStream.finish before seal: the last part is unknown")
        self._queue.put(last)
        del last
        self._thread.join()
        if self.error is not None:
            raise self.error

    def fail(self, error: BaseException) -> None:
        """This writer cannot finish: every rank is told (the preflight's status, or the next
        exchange's). Raises what the ranks agreed on (PeerFailedError naming this writer), or
        the stream's own earlier error."""
        if self._thread.is_alive():
            self._queue.put(_Failed(error))
            self._thread.join()
        raise self.error or error

    def _take(self, blobs: dict[str, bytearray]) -> dict[str, bytearray]:
        part = {}
        for shard, buf in blobs.items():
            if buf:
                part[shard] = buf
                blobs[shard] = bytearray()
                self.blob_bytes[shard] += len(buf)
        return part

    def _exchange(self, tag: str, payloads: dict, *, more: bool = False, status=None):
        got = exchange(
            payloads,
            group=self._group,
            config=self._config,
            status=status,
            tag=part_tag(tag, self.exchanges),
            more=more,
            earlier=[part_tag(tag, k) for k in range(self.exchanges)],
        )
        self.exchanges += 1
        self.bytes_sent += got.stats.bytes_sent
        return got

    def _run(self) -> None:
        try:
            item = self._queue.get()
            tag = self.tag = self._start(item.error if isinstance(item, _Failed) else None)
            while True:
                if isinstance(item, _Failed):
                    self._exchange(tag, {}, status=item.error)  # every rank raises here
                    raise ExchangeError("an exchange with a failure status returned")
                payloads = {
                    dst: item.blobs[shard]
                    for dst, shard in self._first_hop.items()
                    if item.blobs.get(shard)
                }
                got = self._exchange(tag, payloads, more=not item.last)
                del payloads
                if item.last:
                    while got.more:  # other writers still stream: take part, send nothing
                        got = self._exchange(tag, {})
                    return
                del item
                item = self._queue.get()
        except BaseException as exc:
            self.error = exc


def receive_parts(
    *,
    group: dist.ProcessGroup | None,
    config: ExchangeConfig,
    tag: str,
    tags: list[str] | None = None,
) -> dict[int, list[torch.Tensor]]:
    """A receiver's side of one version's exchanges: ``{source rank: [part, ...]}`` in order
    (CPU), for :func:`join_payloads`. ``tags``: each exchange's tag is appended. Raises only
    what an exchange raises: once it returns, this rank took part in every exchange."""
    tags = [] if tags is None else tags
    tags.append(part_tag(tag, 0))
    got = exchange({}, group=group, config=config, tag=tags[-1])
    parts: dict[int, list[torch.Tensor]] = {}
    k = 1
    while True:
        for src, t in as_cpu_bytes(got).items():
            parts.setdefault(src, []).append(t)
        if not got.more:
            break
        tags.append(part_tag(tag, k))
        got = exchange({}, group=group, config=config, tag=tags[-1], earlier=tags[:-1])
        k += 1
    return parts


def join_payloads(parts: dict[int, list[torch.Tensor]], *, where: str) -> dict[int, torch.Tensor]:
    """``{source rank: payload}``, each source's parts joined into one payload, framing in
    front; ``parts`` is emptied as it is joined. A payload that cannot be one (too short for its
    framing) is an EnvelopeError naming ``where`` and the source rank."""
    out = {}
    # each part's pages handed back every few MiB as they are copied, so the payload is never
    # resident twice (with the parts' pages kept, a 0.6B receiver's peak read 1.11x its
    # shard instead of 1.10x)
    release = HeapRelease(JOIN_RELEASE_BYTES)
    for src in sorted(parts):
        pieces = parts.pop(src)
        if len(pieces) == 1 and framed_first(pieces[0]):
            out[src] = pieces[0]
            continue
        try:
            out[src] = join_parts(pieces, on_copied=release.count)
        except EnvelopeError as exc:
            raise EnvelopeError(f"{where}: payload from rank {src}: {exc}") from exc
        del pieces
    return out
