"""Guard-banded BF16 change detection over one parameter: the hot loop of the trainer side.

``detect_adamw_`` ORs into a bitset the elements whose BF16 value may differ from the one
before the last optimizer step (see ``adamw_bound.py`` for why this never misses one).
On CPU it runs the compiled C kernel over 64-element-aligned chunks on a few threads (ctypes
releases the GIL); elsewhere (CUDA, or no C compiler) it runs the same operations, in the same
order and in fp32, as torch expressions over bounded chunks with reused scratch buffers.

Every entry point checks what it is handed first (:func:`deltasync.native.loader.kernel_ready`
and its checks): θ, m and v must be readable fp32 tensors of one shape on one device, the bitset
a 1-D uint8 tensor large enough and not overlapping them. The C kernel runs only on kernel-ready
(plain, contiguous, aligned CPU) tensors; strided, offset, transposed or expanded views and CUDA
tensors take the torch path, which is bit-identical. DTensors, meta tensors and wrong dtypes
raise :class:`~deltasync.errors.TensorInputError` naming the tensor: the kernels never see them.

This module knows tensors and the kernel scalars; it knows nothing about optimizers or names.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import math
import mmap
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from numbers import Integral
from typing import Any, NamedTuple, TypeVar

import torch

from deltasync.errors import TensorInputError
from deltasync.native import loader as native
from deltasync.native.loader import check_bitset, check_readable, check_same_shape, overlaps
from deltasync.native.ops import bf16_at
from deltasync.trainer.adamw_bound import KernelScalars

_CHUNK = 1 << 20  # elements per work item: big enough to amortize calls, small for balance
# On a GPU the torch expressions launch ~20 kernels per chunk: at 2^20 elements launches
# dominate (H200, 1e9 elements: 0.50 s at 2^20, 0.078 s at 2^24, bit-identical). 2^23 keeps
# the transient scratch (~16 temporaries of 4 or 1 bytes per element: ~0.4 GiB) small next
# to a trainer's memory while staying near the launch-bound knee.
_DEVICE_CHUNK = 1 << 23
# A parameter of at most GROUP_NUMEL elements shares its work item with its small neighbours,
# up to GROUP_ELEMENTS elements in all (:func:`detect_adamw_group`): a model's many small
# tensors (norms, biases, a small model's every matrix) cost one kernel call a group instead of
# one each, and far fewer hand-overs between the detection threads and their consumer. The
# small preset's model (47 tensors, 7.2 M elements) on two threads: 11.4 -> 7.3 ms a pass (2^16
# / 2^19 and smaller groups: 8-10 ms; its kernel calls alone: 5.3 ms).
GROUP_NUMEL = 1 << 18
GROUP_ELEMENTS = _CHUNK
_PACK_MAGIC = 0x0102040810204080
T = TypeVar("T")
_pool: ThreadPoolExecutor | None = None
_pool_threads = 0


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool, _pool_threads
    if _pool is None or _pool_threads != threads:
        _pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="deltasync-detect")
        _pool_threads = threads
    return _pool


class Lookahead:
    """Detections run on the detection threads ahead of their consumer, across parameters.

    A tracker walks its parameters in order; ``job(name)`` returns a parameter's work items
    (thunks, one kernel call each, in order: one for a parameter up to ``_CHUNK`` elements,
    one per chunk above; a name may also be a group of small parameters, one item). Up to
    ``2 * threads`` items, of this parameter and of the ones
    after it, are in flight at once, so the threads stay busy across parameter boundaries: a
    model of many small tensors no longer keeps one core busy, and a parameter of three items
    on two threads, or the consumer encoding the end of one parameter, no longer leaves a
    thread idle. :meth:`take` (one item) and :meth:`take_items` (several) hand each name's
    results over in order. ``job(name)`` is called when the name's first item is submitted
    (so what it asks for may depend on what the consumer has seen by then). Results are the
    same as running the jobs in order: each item reads its own part of its parameter only."""

    def __init__(
        self,
        names: Sequence[Hashable],
        job: Callable[[Any], list[Callable[[], T]]],
        *,
        threads: int,
    ) -> None:
        self._names = collections.deque(names)
        self._job = job
        self._pool = _executor(threads) if threads > 1 and names else None
        self._window: collections.deque = collections.deque()  # (name, future), in order
        self._current: tuple[Hashable, Iterator[Callable[[], T]]] | None = None
        self._counts: dict[Hashable, int] = {}
        self._depth = 2 * threads
        self._fill()

    @property
    def threaded(self) -> bool:
        """Whether items run on the detection threads (else nothing is submitted)."""
        return self._pool is not None

    def _fill(self) -> None:
        while self._pool is not None and len(self._window) < self._depth:
            if self._current is None:
                if not self._names:
                    return
                name = self._names.popleft()
                items = self._job(name)
                self._counts[name] = len(items)
                self._current = (name, iter(items))
            name, items = self._current
            item = next(items, None)
            if item is None:
                self._current = None
                continue
            self._window.append((name, self._pool.submit(item)))

    def _next(self, name: Hashable) -> T:
        got, fut = self._window.popleft()
        assert got == name, (got, name)
        self._fill()
        return fut.result()

    def take(self, name: Hashable) -> T | None:
        """The result for a one-item ``name`` if it was submitted (None: detect it yourself)."""
        if not self._window or self._window[0][0] != name or self._counts[name] != 1:
            return None
        return self._next(name)

    def take_items(self, name: Hashable) -> Iterator[T] | None:
        """The results of ``name``'s items in order, as each finishes, if they were submitted
        (None: detect it yourself)."""
        if not self._window or self._window[0][0] != name:
            return None
        return (self._next(name) for _ in range(self._counts[name]))

    def close(self) -> None:
        """Drop what was not taken (an abandoned stream), after the running items end."""
        self._names.clear()
        self._current = None
        for _, fut in self._window:
            fut.cancel()
        for _, fut in self._window:
            if not fut.cancelled():
                fut.exception()
        self._window.clear()


def small_enough(numel: int) -> bool:
    """Whether a parameter is detected in one work item (see :class:`Lookahead`)."""
    return numel <= _CHUNK


def bitset_bytes(numel: int) -> int:
    return (numel + 7) // 8


def check_state(
    p: object,
    m: object,
    v: object,
    *,
    names: tuple[str, str, str] = ("param", "exp_avg", "exp_avg_sq"),
) -> None:
    """Raise :class:`TensorInputError` unless θ, m, v are readable fp32 tensors of one shape
    on one device (what both detection paths need)."""
    f32 = (torch.float32,)
    pt = check_readable(names[0], p, dtypes=f32)
    mt = check_readable(names[1], m, dtypes=f32)
    vt = check_readable(names[2], v, dtypes=f32)
    check_same_shape((names[0], pt), (names[1], mt), (names[2], vt))


def detect_adamw_(
    p: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    k: KernelScalars,
    bits: torch.Tensor,
    *,
    threads: int | None = None,
    force_torch: bool = False,
) -> None:
    """OR the possibly-changed elements of one fp32 parameter into ``bits`` (uint8, LSB first).

    Args:
        p, m, v: the parameter and its two Adam states after the step (fp32, one shape).
        k: the step's kernel scalars.
        bits: 1-D uint8, at least ``ceil(p.numel() / 8)`` bytes, on ``p``'s device.
        threads: C kernel threads (None: torch's intra-op thread count).
        force_torch: take the torch path even where the C kernel could run.

    Raises:
        TensorInputError: an input the detection cannot read (named in the message).
    """
    check_state(p, m, v)
    check_bitset("bits", bits, p.numel(), p.device)
    if any(overlaps(bits, t) for t in (p, m, v)):
        raise TensorInputError("bits overlaps the parameter or its states in memory")
    n = p.numel()
    if n == 0:
        return
    if not math.isfinite(k.abs_e):
        bits.fill_(0xFF)  # bound unavailable (eps <= 0): everything is uncertain
        return
    if not force_torch and native.usable(p, m, v, bits):
        lib = native.load()
        assert lib is not None
        pp, mp, vp, bp = p.data_ptr(), m.data_ptr(), v.data_ptr(), bits.data_ptr()

        def run(start: int) -> int:
            return _detect_bits(lib, k, pp, mp, vp, start, min(_CHUNK, n - start), bp + start // 8)

        starts = range(0, n, _CHUNK)  # _CHUNK is a multiple of 64: no two chunks share a byte
        t = threads or torch.get_num_threads()
        if t <= 1 or n <= _CHUNK:
            for s in starts:
                run(s)
        else:
            list(_executor(t).map(run, starts))
        return
    with torch.no_grad():  # never build an autograd graph over a parameter
        _detect_torch(p.reshape(-1), m.reshape(-1), v.reshape(-1), k, bits)


def _f32(x: float, dev: torch.device) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32, device=dev)


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even BF16 bits of fp32 ``x``; equal to detect.c's for finite values
    (non-finite ones are flagged regardless of their bits)."""
    return x.to(torch.bfloat16).view(torch.int16)


def _detect_torch(
    p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, k: KernelScalars, bits: torch.Tensor
) -> None:
    dev = p.device
    bc2s, eps, ss = _f32(k.bc2s, dev), _f32(k.eps, dev), _f32(k.step_size, dev)
    inv_c, rs, ru, ae = (
        _f32(k.inv_c, dev),
        _f32(k.rel_s, dev),
        _f32(k.rel_u, dev),
        _f32(k.abs_e, dev),
    )
    n = p.numel()
    chunk = _CHUNK if dev.type == "cpu" else _DEVICE_CHUNK  # both multiples of 8: whole bytes
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        pc, mc, vc = p[start:end], m[start:end], v[start:end]
        d = torch.sqrt(vc) / bc2s + eps
        u = (mc / d) * ss
        s = pc + u
        r = s * inv_c
        e = (s.abs() * rs + u.abs() * ru) * inv_c + ae
        lo, hi = r - e, r + e
        blo, bhi, bcur = _bf16_bits(lo), _bf16_bits(hi), _bf16_bits(pc)
        flag = (
            (blo != bhi)
            | (blo != bcur)
            | ~torch.isfinite(lo)
            | ~torch.isfinite(hi)
            | ~torch.isfinite(pc)
        )
        pad = (-flag.numel()) % 8
        if pad:
            flag = torch.cat([flag, flag.new_zeros(pad)])
        # 8 one-byte flags -> one byte: a multiply gathers byte j's low bit into bit 56 + j
        # (all partial products are distinct powers of two, so nothing carries).
        q = flag.contiguous().view(torch.uint8).view(torch.int64)
        packed = (((q * _PACK_MAGIC) >> 56) & 0xFF).to(torch.uint8)
        bits[start // 8 : start // 8 + packed.numel()] |= packed


def bits_to_indices(bits: torch.Tensor, numel: int) -> torch.Tensor:
    """Sorted int64 positions of the set bits among the first ``numel`` bits."""
    if not isinstance(numel, Integral) or isinstance(numel, bool) or numel < 0:
        raise TensorInputError(f"bits_to_indices: numel must be a non-negative int, got {numel!r}")
    check_bitset("bits", bits, numel)
    nbytes = bitset_bytes(numel)
    if numel == 0:
        return torch.empty(0, dtype=torch.int64)
    if native.usable(bits):
        lib = native.load()
        assert lib is not None
        count = lib.ds_bits_count(bits.data_ptr(), nbytes)
        out = torch.empty(count, dtype=torch.int64)
        if count:
            lib.ds_bits_to_indices(bits.data_ptr(), nbytes, 0, out.data_ptr())
        return out[out < numel] if count and out[-1] >= numel else out
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    unpacked = ((bits[:nbytes].unsqueeze(1) >> shifts) & 1).reshape(-1)[:numel]
    return torch.nonzero(unpacked, as_tuple=False).reshape(-1).to(torch.int64)


_scratch = threading.local()


def _scalars(k: KernelScalars) -> tuple[float, ...]:
    """The kernels' per-step scalar arguments, in their C signature's order."""
    return (k.bc2s, k.eps, k.step_size, k.inv_c, k.rel_s, k.rel_u, k.abs_e)


def _detect_bits(lib, k: KernelScalars, pp: int, mp: int, vp: int, start: int, cnt: int, bp: int):
    """The C kernel over elements ``[start, start + cnt)`` of θ, m, v (at ``pp``, ``mp``,
    ``vp``) into the bitset at ``bp``; returns how many bits it set."""
    off = start * 4
    return lib.ds_adamw_detect(
        pp + off,
        mp + off,
        vp + off,
        cnt,
        *_scalars(k),
        bp,
    )


def _chunk_indices(
    lib, k: KernelScalars, pp: int, mp: int, vp: int, start: int, cnt: int
) -> torch.Tensor:
    """One chunk's flagged positions (sorted int64, absolute), through this thread's scratch
    bitset: nothing per element outlives the call but the positions themselves."""
    buf = getattr(_scratch, "buf", None)
    if buf is None:
        buf = _scratch.buf = torch.empty(_CHUNK // 8, dtype=torch.uint8)
    nbytes = bitset_bytes(cnt)
    buf[:nbytes].zero_()
    found = _detect_bits(lib, k, pp, mp, vp, start, cnt, buf.data_ptr())
    out = torch.empty(found, dtype=torch.int64)
    if found:
        lib.ds_bits_to_indices(buf.data_ptr(), nbytes, start, out.data_ptr())
    return out


# What a list scratch set keeps resident between chunks (see _ListScratch): the positions and
# values of a chunk with up to 1/8 of its elements flagged.
_KEEP_ELEMENTS = _CHUNK // 8


class _ScratchBuffer:
    """``n`` elements of ``dtype`` in anonymous pages of their own, not the C heap: a page is
    resident only once something wrote to it, and :meth:`shed` hands the pages past the first
    ``keep`` elements back to the OS (read as zeros when touched again). Heap memory offers
    neither: a buffer carved from pages an earlier, larger allocation left resident is resident
    whole, written or not, and stays so while it lives (the 0.6B benchmark's trainer held a
    whole set, 10 MiB, that way). Where the platform cannot advise, a plain tensor."""

    def __init__(self, n: int, dtype: torch.dtype, keep: int) -> None:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self._map: mmap.mmap | None = None
        if hasattr(mmap, "MADV_DONTNEED") and hasattr(mmap.mmap, "madvise"):
            # private: MADV_DONTNEED frees a private mapping's pages (a shared one keeps them)
            self._map = mmap.mmap(-1, n * itemsize, flags=mmap.MAP_PRIVATE)
            self.tensor = torch.frombuffer(self._map, dtype=dtype, count=n)
        else:
            self.tensor = torch.empty(n, dtype=dtype)
        self._from = -(-keep * itemsize // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages kept

    def shed(self) -> None:
        if self._map is not None and self._from < len(self._map):
            self._map.madvise(mmap.MADV_DONTNEED, self._from, len(self._map) - self._from)


class _ListScratch:
    """The outputs of the list kernels for one chunk (int64 positions and BF16 values: 10 bytes
    per chunk element), lent to one caller at a time and reused: only the compact copies of
    what was found are allocated per version. Shared by every thread rather than one set per
    thread, so a process holds as many sets as ran at once. Each set lives in pages of its own
    and sheds what lies past the first ``_KEEP_ELEMENTS`` entries when it comes back: a set
    keeps ~1.2 MiB resident between chunks whatever a dense chunk wrote into it (10 MiB)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[tuple[_ScratchBuffer, _ScratchBuffer]] = []

    @contextlib.contextmanager
    def lend(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """A set for the ``with`` block; copy out what it found before the block ends."""
        with self._lock:
            bufs = self._free.pop() if self._free else None
        if bufs is None:
            bufs = (
                _ScratchBuffer(_CHUNK, torch.int64, _KEEP_ELEMENTS),
                _ScratchBuffer(_CHUNK, torch.bfloat16, _KEEP_ELEMENTS),
            )
        try:
            yield bufs[0].tensor, bufs[1].tensor
        finally:
            for b in bufs:
                b.shed()
            with self._lock:
                self._free.append(bufs)


_LISTS = _ListScratch()


def detect_adamw_indices(
    p: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    k: KernelScalars,
    *,
    threads: int | None = None,
) -> torch.Tensor:
    """Sorted int64 positions that may have changed in the last step, without a bitset.

    Used when one optimizer step makes one version (the common case): each chunk is detected
    into a small per-thread scratch bitset and expanded at once, so the tracker holds no
    per-element memory at all between versions.
    """
    return _detect_chunked(p, m, v, k, threads=threads, values=False)[0]


class CastBuffers:
    """The BF16 buffers one detection pass casts its chunks into (``chunk_items``' ``cast``),
    reused: each chunk takes one and the consumer gives it back once it has hashed the bits,
    so a pass holds as many as are in flight at once (the :class:`Lookahead` window), not one
    per chunk. (A fresh 2 MiB buffer per chunk cost page faults on every one, and its freed
    space lay between the positions kept meanwhile, where the heap could not reuse it.)
    Dropped with the pass."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._made: dict[int, torch.Tensor] = {}  # data_ptr -> buffer, of every one made

    def take(self, n: int) -> torch.Tensor:
        """A buffer for ``n <= _CHUNK`` BF16 elements (its first ``n``)."""
        with self._lock:
            buf = self._free.pop() if self._free else None
        if buf is None:
            buf = torch.empty(_CHUNK, dtype=torch.bfloat16)
            with self._lock:
                self._made[buf.data_ptr()] = buf
        return buf[:n]

    def give(self, bits: torch.Tensor) -> None:
        """Return a buffer :meth:`take` gave (anything else is ignored)."""
        with self._lock:
            buf = self._made.get(bits.data_ptr())
            if buf is not None:
                self._free.append(buf)


Chunk = tuple[torch.Tensor, torch.Tensor | None]  # sorted int64 positions, BF16 values or None
# ... and the BF16 bits of every element of the chunk, or None (see chunk_items' ``cast``)
CastChunk = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def chunk_items(
    p: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    k: KernelScalars,
    *,
    values: bool,
    cast: CastBuffers | None = None,
) -> list[Callable[[], Any]]:
    """One step's detection as work items: one thunk per ``_CHUNK``-element chunk, each giving
    that chunk's sorted int64 positions (absolute) and, with ``values``, their BF16 values, to
    run in order or on any thread (:class:`Lookahead`); a single whole-tensor item where the
    kernel cannot run. :func:`join_chunks` puts the results together.

    With ``cast`` each item gives a :data:`CastChunk` instead: also the BF16 bits of every
    element of its chunk, in order (what the receivers' state digest hashes: a
    :class:`~deltasync.layout.digest_feed.DigestFeed` takes them), cast by the kernel from the
    values its test just read into a buffer of ``cast`` (the consumer gives it back); None
    where the kernel could not (the whole-tensor path, a NaN or fp32 subnormal in the chunk),
    and the digest then reads that parameter itself."""
    check_state(p, m, v)
    n = p.numel()
    if n == 0:
        return []
    if not (math.isfinite(k.abs_e) and native.usable(p, m, v)):

        def whole() -> Chunk | CastChunk:  # the bitset path (torch where the kernel cannot read)
            check_state(p, m, v)  # as they are now: it runs later, maybe on another thread
            bits = torch.zeros(bitset_bytes(n), dtype=torch.uint8, device=p.device)
            detect_adamw_(p, m, v, k, bits, threads=1)
            idx = bits_to_indices(bits, n)
            vals = bf16_at(p, idx, trusted=True) if values else None
            return (idx, vals, None) if cast is not None else (idx, vals)

        return [whole]
    lib = native.load()
    assert lib is not None
    pp, mp, vp = p.data_ptr(), m.data_ptr(), v.data_ptr()
    flat = p.view(-1)

    def still() -> None:
        """The tensors as they were checked, when a chunk runs (later, maybe on another
        thread): a storage freed or swapped since would be read through stale pointers."""
        if not native.usable(p, m, v) or (p.data_ptr(), m.data_ptr(), v.data_ptr()) != (
            pp,
            mp,
            vp,
        ):
            raise TensorInputError(
                f"a parameter of {n} elements (or its exp_avg / exp_avg_sq) was freed, resized "
                "or moved while its chunks were detected (e.g. resharded by FSDP in the "
                "middle of a step): detection reads a step's tensors as they are until it ends"
            )

    def listed(kernel: Callable[..., int], start: int, cnt: int, *outs: int | None) -> int:
        """A list kernel over one chunk; ``outs``: its output pointers."""
        still()
        off = start * 4
        return kernel(pp + off, mp + off, vp + off, cnt, *_scalars(k), start, *outs)

    def run_cast(start: int) -> CastChunk:
        cnt = min(_CHUNK, n - start)
        assert cast is not None
        bits = cast.take(cnt)  # handed on: the consumer hashes it, then gives it back
        with _LISTS.lend() as (ibuf, vbuf):
            vptr = vbuf.data_ptr() if values else None
            found = listed(
                lib.ds_adamw_detect_list_cast, start, cnt, ibuf.data_ptr(), vptr, bits.data_ptr()
            )
            if found >= 0:
                return ibuf[:found].clone(), (vbuf[:found].clone() if values else None), bits
        cast.give(bits)
        idx, vals = run(start)  # a NaN or subnormal somewhere in the chunk: no cast
        return idx, vals, None

    def run(start: int) -> Chunk:
        cnt = min(_CHUNK, n - start)
        if values:  # positions and BF16 values straight from the kernel, block by block
            with _LISTS.lend() as (ibuf, vbuf):
                found = listed(
                    lib.ds_adamw_detect_list, start, cnt, ibuf.data_ptr(), vbuf.data_ptr()
                )
                if found >= 0:
                    return ibuf[:found].clone(), vbuf[:found].clone()
            # a flagged NaN or subnormal: the bitset path below, and torch casts the values
        still()
        out = _chunk_indices(lib, k, pp, mp, vp, start, cnt)
        if not values:
            return out, None
        return out, bf16_at(flat, out, trusted=True)

    def item(start: int) -> Callable[[], Any]:
        return (lambda: run_cast(start)) if cast is not None else (lambda: run(start))

    return [item(s) for s in range(0, n, _CHUNK)]


def join_chunks(parts: list[Chunk], *, values: bool) -> Chunk:
    """The chunks' positions (and, with ``values``, their values) as one pair, in order."""
    if not parts:
        empty = torch.empty(0, dtype=torch.bfloat16) if values else None
        return torch.empty(0, dtype=torch.int64), empty
    if len(parts) == 1:
        return parts[0]
    idx = torch.cat([a for a, _ in parts])
    return idx, (torch.cat([b for _, b in parts]) if values else None)  # type: ignore[misc]


def detect_adamw_chunks(
    p: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    k: KernelScalars,
    *,
    threads: int | None = None,
    values: bool,
    cast: CastBuffers | None = None,
) -> Iterator[Any]:
    """:func:`detect_adamw_indices` chunk by chunk: per ``_CHUNK``-element chunk, in order, as
    each is detected (a few chunks ahead on the kernel threads), its sorted int64 positions
    and, with ``values``, the BF16 values at them (written by the kernel as it flags them).
    The caller encodes each as it comes (:meth:`Positions.from_chunks`), so the int64
    positions of a whole parameter (the embedding's: tens of MiB) never exist. ``cast``:
    :data:`CastChunk` triples instead (see :func:`chunk_items`)."""
    items = chunk_items(p, m, v, k, values=values, cast=cast)
    t = threads or torch.get_num_threads()
    if t <= 1 or len(items) <= 1:
        for item in items:
            yield item()
        return
    ahead = Lookahead(["chunks"], lambda _: items, threads=t)
    try:
        yield from ahead.take_items("chunks") or ()
    finally:
        ahead.close()


def detect_adamw_changes(
    p: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    k: KernelScalars,
    *,
    threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`detect_adamw_indices`, plus the current BF16 values at those positions.

    The C kernel writes each flagged position and its value as it finishes each 64-element
    block (no bitset): measured 0.16 s per 100 M elements, the same as indices alone, where a
    bitset pass plus a gather per chunk took 0.19-0.24 s and a separate cache-cold gather
    ~40% more. The publisher then needs no second pass over the parameter."""
    idx, vals = _detect_chunked(p, m, v, k, threads=threads, values=True)
    assert vals is not None
    return idx, vals


State = tuple[torch.Tensor, torch.Tensor, torch.Tensor, KernelScalars]  # θ, m, v, scalars


class Group(NamedTuple):
    """:func:`detect_adamw_group`'s answer: each parameter's sorted int64 positions and BF16
    values, and with ``cast`` the BF16 bits of its every element (a view of ``shared``, the
    group's one buffer of ``cast``, for the consumer to give back once it has hashed them
    all; None where the kernel could not cast)."""

    found: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]
    shared: torch.Tensor | None


def detect_adamw_group(states: Sequence[State], *, cast: CastBuffers | None = None) -> Group:
    """:func:`detect_adamw_changes` of several small parameters (at most ``_CHUNK`` elements
    in all), in order, in one kernel call where the kernel can read them all; with ``cast``,
    also each one's BF16 bits of every element (as :func:`chunk_items`' ``cast``).

    One call from the interpreter (one release of its lock) for the group instead of one per
    parameter: a small model's detection on two threads was mostly hand-overs between the
    threads and their consumer, not kernel time. Each result's positions and values are
    views of one buffer for the group. Where the kernel cannot take every parameter (a
    strided view, a non-finite bound, a NaN or fp32 subnormal value flagged, or with ``cast``
    anywhere), each is detected on its own, with the same positions and values (and no
    bits)."""
    for p, m, v, _ in states:
        check_state(p, m, v)
    total = sum(p.numel() for p, _, _, _ in states)
    if total > _CHUNK:
        raise ValueError(f"a detection group holds at most {_CHUNK} elements, got {total}")
    lib = (
        native.load()
        if all(math.isfinite(k.abs_e) and native.usable(p, m, v) for p, m, v, k in states)
        else None
    )
    if lib is not None and states:
        count = len(states)
        addr = ctypes.c_int64 * count
        numels = [p.numel() for p, _, _, _ in states]
        scalars = (ctypes.c_float * (7 * count))(*(x for *_, k in states for x in _scalars(k)))
        found = addr()
        shared = None if cast is None else cast.take(max(total, 1))
        with _LISTS.lend() as (ibuf, vbuf):
            got = lib.ds_adamw_detect_list_many(
                count,
                addr(*(p.data_ptr() for p, _, _, _ in states)),
                addr(*(m.data_ptr() for _, m, _, _ in states)),
                addr(*(v.data_ptr() for _, _, v, _ in states)),
                addr(*numels),
                scalars,
                ibuf.data_ptr(),
                vbuf.data_ptr(),
                None if shared is None else shared.data_ptr(),
                found,
            )
            if got >= 0:  # copied out before the set goes back
                counts = list(found)
                idx = ibuf[:got].clone().split(counts)
                vals = vbuf[:got].clone().split(counts)
                bits = [None] * count if shared is None else shared[:total].split(numels)
                return Group(list(zip(idx, vals, bits, strict=True)), shared)
        if cast is not None and shared is not None:
            cast.give(shared)
    return Group(
        [(*detect_adamw_changes(p, m, v, k, threads=1), None) for p, m, v, k in states], None
    )


def _detect_chunked(
    p: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    k: KernelScalars,
    *,
    threads: int | None,
    values: bool,
) -> Chunk:
    items = chunk_items(p, m, v, k, values=values)
    t = threads or torch.get_num_threads()
    if t > 1 and len(items) > 1:
        return join_chunks(list(_executor(t).map(lambda item: item(), items)), values=values)
    return join_chunks([item() for item in items], values=values)
