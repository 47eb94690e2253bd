"""Receiver tensors' state-digest entries from the detection pass's own BF16 casts.

The shard-state digest (:mod:`deltasync.layout.digest`) hashes each receiver tensor's bytes in
row-major order with one streaming xxh3-128. A tensor whose rows are whole row blocks of
canonical tensors (each canonical tensor one contiguous row range of one trainer parameter:
:meth:`TrainerLayout.canonical_spans`) reads, in its own order, runs of its parameters' flat
elements: a fused ``qkv_proj`` shard the rows of ``q_proj``, ``k_proj`` and ``v_proj`` that shard
holds, one after the other; a row-parallel ``o_proj`` shard a column range of every row; the
embedding's shard its vocabulary rows and then zero rows of padding. When the parameters'
BF16 bits arrive in that order (the tracker's detection pass casts each chunk it tests:
:func:`deltasync.trainer.detect.chunk_items` with ``cast``), every such tensor is hashed as
they pass, and the per-version digest pass has nothing left to read for it.

:class:`DigestFeed` keeps one hash state and one cursor per receiver tensor. :meth:`~DigestFeed.feed`
takes elements ``[start, start + n)`` of one parameter and hands each tensor the runs it is
waiting for; a run that arrives before the tensor's earlier bytes (its parameters detected in
another order), a parameter whose bits cannot come (:meth:`~DigestFeed.fail`: a NaN in a chunk,
a path that does not cast) and a parameter never fed leave the tensor incomplete.
:meth:`~DigestFeed.entries` gives the complete tensors' entries, bit for bit those
:func:`~deltasync.layout.digest.state_tensor_digests` computes from the same parameters; the
digest pass computes the rest as before. So a feed can only save work: it never changes a
digest.

This module knows layouts and the digest definition; nothing about trackers or stores.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field

import torch
import xxhash

from deltasync.layout.blocks import numel, view_cols, view_rows
from deltasync.layout.digest import TensorEntries, feed_zeros
from deltasync.layout.receiver_layout import ReceiverLayout
from deltasync.layout.trainer_layout import TrainerLayout

_BF16_BYTES = 2
_ROW_BUFFER_ELEMENTS = 1 << 17  # 256 KiB: a column block goes through it a few rows at a time
_tls = threading.local()


def _row_buffer() -> torch.Tensor:
    """This thread's BF16 buffer for column blocks (made on first use, then kept)."""
    buf = getattr(_tls, "rows", None)
    if buf is None or buf.numel() != _ROW_BUFFER_ELEMENTS:
        buf = _tls.rows = torch.empty(_ROW_BUFFER_ELEMENTS, dtype=torch.bfloat16)
    return buf


@dataclass(frozen=True)
class _Run:
    """One block of a receiver tensor, in its parameter's flat coordinates: ``rows`` rows of
    ``cols`` elements, row ``r`` starting at ``first + r * stride``; ``zeros`` bytes of the
    tensor (uncovered rows) come before it."""

    param: str
    first: int
    stride: int
    cols: int
    rows: int
    zeros: int

    @property
    def whole(self) -> bool:
        """The rows touch end to end: one flat range of the parameter."""
        return self.cols == self.stride

    @property
    def stop(self) -> int:
        return self.first + (self.rows - 1) * self.stride + self.cols


@dataclass
class _Tensor:
    """One receiver tensor's hash as far as its bytes have arrived."""

    shard: str
    local: str
    shape: tuple[int, ...]
    runs: tuple[_Run, ...]
    tail: int  # zero bytes after the last run
    hasher: xxhash.xxh3_128 = field(default_factory=xxhash.xxh3_128)
    run: int = 0  # the run being fed
    done: int = 0  # its elements fed so far (row-major within the run)
    broken: bool = False
    digest: bytes | None = None

    def __post_init__(self) -> None:
        self._enter()

    @property
    def complete(self) -> bool:
        """Every byte arrived, in order: ``digest`` is the tensor's."""
        return self.digest is not None and not self.broken

    def _enter(self) -> None:
        """Feed the zeros before the current run (after the last: the tail) and finish."""
        while self.run < len(self.runs) and self.runs[self.run].rows == 0:
            self.run += 1
        if self.run < len(self.runs):
            feed_zeros(self.hasher, self.runs[self.run].zeros)
            return
        feed_zeros(self.hasher, self.tail)
        self.digest = self.hasher.digest()

    def expects(self) -> int:
        """The parameter position of the next element this tensor needs."""
        r = self.runs[self.run]
        row, col = divmod(self.done, r.cols)
        return r.first + row * r.stride + col

    def take(self, param: str, start: int, bits: torch.Tensor) -> None:
        """Hash what ``bits`` (elements ``[start, start + len)`` of ``param``) holds for this
        tensor, in order; break if it holds bytes of a later run than the one awaited."""
        stop = start + bits.numel()
        while self.digest is None and not self.broken:
            r = self.runs[self.run]
            if r.param != param:
                # Waiting for another parameter: bytes of this one for a later run would come
                # out of order (fine only if none lie in this chunk).
                self.broken = any(
                    later.param == param and later.first < stop and later.stop > start
                    for later in self.runs[self.run + 1 :]
                )
                return
            at = self.expects()
            if at < start:
                self.broken = True  # its bytes went by before this tensor was waiting
                return
            if at >= stop:
                return
            self.done += self._hash_from(r, at, start, bits, stop)
            if self.done == r.rows * r.cols:
                self.run, self.done = self.run + 1, 0
                self._enter()

    def _hash_from(self, r: _Run, at: int, start: int, bits: torch.Tensor, stop: int) -> int:
        """Hash the run's elements from parameter position ``at`` on that ``bits`` holds;
        returns how many."""
        if r.whole:
            n = min(stop, r.stop) - at
            self._update(bits[at - start : at - start + n])
            return n
        col = self.done % r.cols
        if col:  # finish the row begun in the last chunk
            n = min(r.cols - col, stop - at)
            self._update(bits[at - start : at - start + n])
            return n
        row = self.done // r.cols
        rows = min(r.rows - row, (stop - at - r.cols) // r.stride + 1 if stop - at >= r.cols else 0)
        if rows:  # whole rows: their column range, copied a few rows at a time
            span = bits[at - start : at - start + (rows - 1) * r.stride + r.cols]
            self._update_rows(torch.as_strided(span, (rows, r.cols), (r.stride, 1)))
            return rows * r.cols
        n = min(r.cols, stop - at)  # the row goes on in the next chunk
        self._update(bits[at - start : at - start + n])
        return n

    def _update_rows(self, block: torch.Tensor) -> None:
        """Hash a strided 2-D block in row-major order through this thread's row buffer: a
        copy of the whole block (a row-parallel shard's column half, 3 MiB at 0.6B) was a
        fresh allocation every time, ~20 k page faults a 0.6B version."""
        buf = _row_buffer()
        rows, cols = block.shape
        step = max(1, buf.numel() // cols)
        for lo in range(0, rows, step):
            piece = block[lo : lo + step]
            n = piece.numel()
            if n > buf.numel():  # one row wider than the buffer: copied on its own
                self._update(piece.contiguous().reshape(-1))
                continue
            buf[:n].view(piece.shape).copy_(piece)
            self._update(buf[:n])

    def _update(self, bits: torch.Tensor) -> None:
        if bits.numel():
            self.hasher.update(memoryview(bits.view(torch.uint8).numpy()))


class DigestFeed:
    """Hashes receiver tensors from their parameters' BF16 bits as detection casts them.

    Args:
        trainer_layout: trainer parameters -> canonical tensors.
        receiver_layout: canonical tensors -> receiver shards.
        params: the names the caller may feed (e.g. the parameters this trainer holds whole);
            None: every trainer parameter.
    """

    def __init__(
        self,
        trainer_layout: TrainerLayout,
        receiver_layout: ReceiverLayout,
        params: set[str] | frozenset[str] | None = None,
    ) -> None:
        spans = trainer_layout.canonical_spans()
        table = receiver_layout.table
        canon_shapes = table.src_shapes
        by_dst: dict[tuple[str, str], list] = {}
        for canon, pls in table.placements.items():
            for p in pls:
                if p.block.size:
                    by_dst.setdefault((p.shard, p.local), []).append((canon, p.block))
        # the plan: (shard, local, shape, runs, tail) of every tensor the feed can hash
        self._plan: list[tuple[str, str, tuple[int, ...], tuple[_Run, ...], int]] = []
        every = [(shard, local) for shard, shapes in table.dst_shapes.items() for local in shapes]
        for shard, local in every:  # a tensor no block covers (all padding) is all zeros
            blocks = sorted(by_dst.get((shard, local), []), key=lambda cb: cb[1].dst_row)
            if not all(b.dst_full_width and canon in spans for canon, b in blocks):
                continue  # blocks side by side, or a canonical tensor of several pieces
            if params is not None and any(spans[c][0] not in params for c, _ in blocks):
                continue
            shape = tuple(table.dst_shapes[shard][local])
            row_bytes = view_cols(shape) * _BF16_BYTES
            runs, cursor = [], 0
            for canon, b in blocks:
                param, first = spans[canon]
                width = view_cols(tuple(canon_shapes[canon]))
                runs.append(
                    _Run(
                        param=param,
                        first=first + b.src_row * width + b.src_col,
                        stride=width,
                        cols=b.cols,
                        rows=b.rows,
                        zeros=(b.dst_row - cursor) * row_bytes,
                    )
                )
                cursor = b.dst_row + b.rows
            tail = (view_rows(shape) - cursor) * row_bytes
            self._plan.append((shard, local, shape, tuple(runs), tail))
        self._start()

    def _start(self) -> None:
        """Fresh hash states and cursors for every planned tensor."""
        self._tensors = [
            _Tensor(shard, local, shape, runs, tail=tail)
            for shard, local, shape, runs, tail in self._plan
        ]
        self._by_param: dict[str, list[_Tensor]] = {}
        for tensor in self._tensors:
            for name in dict.fromkeys(r.param for r in tensor.runs):
                self._by_param.setdefault(name, []).append(tensor)
        self._failed: set[str] = set()

    def fresh(self) -> DigestFeed:
        """A new feed over the same layouts (the plan is shared, nothing is hashed yet): one
        per version."""
        new = copy.copy(self)
        new._start()
        return new

    def wants(self, name: str) -> bool:
        """Whether some receiver tensor is hashed from parameter ``name``'s bits."""
        return name in self._by_param

    def feed(self, name: str, start: int, bits: torch.Tensor) -> None:
        """Elements ``[start, start + bits.numel())`` of parameter ``name`` (flat, row-major),
        as BF16 on the CPU; a parameter's chunks must come in order."""
        if name in self._failed:
            return
        flat = bits.reshape(-1)
        if flat.dtype != torch.bfloat16 or flat.device.type != "cpu" or not flat.is_contiguous():
            self.fail(name)
            return
        for tensor in self._by_param.get(name, ()):
            tensor.take(name, start, flat)

    def fail(self, name: str) -> None:
        """Parameter ``name``'s bits will not (all) come: its tensors are left to the digest
        pass."""
        self._failed.add(name)
        for tensor in self._by_param.get(name, ()):
            tensor.broken = True

    def entries(self) -> TensorEntries:
        """``{shard: {local: (dtype name, shape, tensor digest)}}`` of every tensor whose bytes
        all arrived in order."""
        out: TensorEntries = {}
        for t in self._tensors:
            if t.complete:
                out.setdefault(t.shard, {})[t.local] = ("bfloat16", t.shape, t.digest)
        return out

    def covered(self) -> int:
        """Elements of the complete tensors (what the digest pass need not read)."""
        return sum(numel(t.shape) for t in self._tensors if t.complete)
