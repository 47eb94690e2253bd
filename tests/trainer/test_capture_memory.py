"""The overlapped capture holds about a byte per changed element, never a parameter's int64
positions, and the background publish of the largest parameter holds its records' bytes and a
slice, never its int64 positions and values: measured on the process's resettable RSS
high-water mark (Linux), on a parameter large enough that an int64 copy of its positions would
stand far above the bound."""

from __future__ import annotations

import gc

import torch
from kit import build_model, in_fresh_process, settled_rss, status_kib, tiny_layouts, tiny_qwen3

from deltasync import AdamWTracker, LocalStore, Publisher, PublisherConfig
from deltasync.trainer.positions import Positions

N = 24 * 2**20  # elements: ~2.6 M change in AdamW's first step at lr 3e-6


def test_capturing_positions_costs_a_byte_per_change_not_an_int64_copy() -> None:
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(N, generator=g) * 0.02)
    opt = torch.optim.AdamW([p], lr=3e-6, weight_decay=0.01)
    tracker = AdamWTracker(opt, [("w", p)], threads=2)
    p.grad = torch.randn(N, generator=g) * 1e-3
    opt.step()
    p.grad = None
    truth = tracker.changed()["w"]  # the same pending step: asking again gives the same answer
    count = truth.numel()
    assert count > 2_000_000  # their int64 positions: > 16 MiB
    dict(tracker.iter_positions())  # warm: kernel threads, their scratch, allocator arenas
    base = settled_rss()
    captured = dict(tracker.iter_positions())
    peak = status_kib("VmHWM") * 1024 - base
    assert torch.equal(captured["w"].indices(), truth)
    held = captured["w"].nbytes
    assert held <= count * 1.1
    # Concatenating the chunks' int64 outputs (and a whole-tensor diff to encode them) held
    # two to three int64 copies at once: measured 42 MiB here for 2.6 M changes. Chunk by chunk
    # it is the gap bytes (twice, at their final cat) and a window of chunks in flight: 15-16
    # MiB measured. The bound is less than one int64 copy of the positions.
    assert peak < 8 * count, (peak, count)


EMBED = "model.embed_tokens.weight"


def _measure_row_piece(root: str) -> tuple[str, int, int, int]:
    vocab = 1 << 18  # x hidden 64: 16.8 M elements, two pieces of 8.4 M at TP=2
    _, tl, rl = tiny_layouts("vllm", tp=2, vocab_size=vocab)
    params = {
        n: p.detach() for n, p in build_model(tiny_qwen3(vocab_size=vocab)).named_parameters()
    }
    pub = Publisher(
        LocalStore(root, durable=False),
        receiver_layout=rl,
        trainer_layout=tl,
        config=PublisherConfig(anchor_every=1000, session="mem"),
    )
    pub.publish(0, [], params, anchor=True)
    g = torch.Generator().manual_seed(1)

    def changes() -> tuple[list, int]:
        out, piece = [], 0
        for name, p in params.items():
            idx = torch.nonzero(torch.rand(p.numel(), generator=g) < 0.16).reshape(-1)
            p.view(-1)[idx] += 0.01  # a new state at exactly these positions
            if name == EMBED:
                piece = max(int((idx < p.numel() // 2).sum()), int((idx >= p.numel() // 2).sum()))
            out.append((name, Positions.of(idx), None))
        return out, piece

    first, _ = changes()
    pub.publish(1, first, params)  # warm: upload and digest threads, kernels, allocator arenas
    del first
    captured, piece = changes()
    assert piece > 1_200_000  # as int64 with their values: > 12 MiB for one piece
    base = settled_rss()
    rep = pub.publish(2, captured, params)
    peak = status_kib("VmHWM") * 1024 - base
    pub.close()
    return rep.kind, peak, 3 * piece + max(rep.shard_bytes.values()), piece


def test_publishing_a_row_piece_holds_its_record_bytes_and_a_slice_not_its_int64_indices(
    tmp_path,
) -> None:
    """The background half of an overlapped publish: captured positions in, blobs out. The
    vocab-parallel embedding (the trainer's largest tensor) is routed piece by piece; what a
    piece costs above its own record bytes (its zstd frame, which the format needs whole: the
    frame's length comes first; below the one-shot size also its raw section) must be a bounded
    slice, not its positions as int64 plus their values (10 bytes per changed element)."""
    kind, peak, record, piece = in_fresh_process(_measure_row_piece, str(tmp_path))
    assert kind == "delta"
    # At 16% the gaps fit one byte: a piece's record is 3 bytes per element raw, and its zstd
    # frame is at most the shard's whole blob. Measured above both: 31 MiB when each piece's
    # int64 positions, values and an 8 MiB decoding scratch existed at once; 9-10 MiB written a
    # 65536-position slice at a time. The allowance is slice-sized: the slices (~2 MiB), the
    # digest pass's 4 MiB staging buffer running beside it, and the previous piece's frame on
    # its way to the store.
    assert peak < record + 14 * 2**20, (peak, record, piece)


def _holes_released() -> tuple[int, int]:
    """Frees every other of many heap-sized buffers (each pinned by the next); the RSS before
    and after :func:`release_free_heap`."""
    from deltasync.native.loader import release_free_heap

    bufs = [bytearray(100_000 + i) for i in range(800)]  # 80 MiB below the mmap threshold
    for b in bufs:
        b[::4096] = b"\1" * len(b[::4096])  # touch every page
    del bufs[::2]
    gc.collect()
    before = status_kib("VmRSS") * 1024
    release_free_heap()
    return before, status_kib("VmRSS") * 1024


def test_releasing_the_free_heap_hands_freed_holes_back_to_the_system() -> None:
    """glibc keeps freed chunks that live objects pin resident; the publisher releases them
    between segments (its peak would otherwise grow by what earlier segments freed)."""
    before, after = in_fresh_process(_holes_released)
    assert before - after > 30 * 2**20, (before, after)  # ~40 MiB of holes


def _dense_chunk_stepped(
    n: int, *, seed: int
) -> tuple[torch.nn.Parameter, torch.Tensor, AdamWTracker]:
    """A parameter of ``n`` small weights after one AdamW step large enough to flag every
    element; its BF16 bits before the step; the tracker watching it."""
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(n, generator=g) * 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-2)
    tracker = AdamWTracker(opt, [("w", p)], threads=1)
    p.grad = torch.randn(n, generator=g)
    before = p.detach().to(torch.bfloat16)
    opt.step()
    return p, before, tracker


def _resident_after_detection_on_two_threads() -> tuple[int, int]:
    """RSS above the settled baseline after a dense parameter was detected on this thread and
    then on another one that lives on (as a sender's detection thread does), the kernel's
    list outputs fully written each time; and the sets of list outputs the process holds."""
    import threading

    from deltasync.trainer import detect

    n = 1 << 20  # one chunk, every element changed: its whole 10 MiB of list outputs written
    _, _, tracker = _dense_chunk_stepped(n, seed=1)
    base = settled_rss()
    assert tracker.changed_values()["w"][0].numel() == n
    detected, done = threading.Event(), threading.Event()

    def detect_and_live_on() -> None:
        tracker.changed_values()
        detected.set()
        done.wait()

    other = threading.Thread(target=detect_and_live_on)
    other.start()
    detected.wait()
    gc.collect()
    resident = settled_rss() - base
    done.set()
    other.join()
    return resident, len(detect._LISTS._free)


def test_detection_on_two_threads_one_after_the_other_keeps_one_set_of_list_outputs() -> None:
    # One set per thread kept 20 MiB resident here while both threads lived (the caller's
    # pass, then the detection thread's): shared, the second pass reuses the first one's (11
    # MiB resident), and it sheds all but an eighth of what the dense chunk wrote (2 MiB).
    resident, sets = in_fresh_process(_resident_after_detection_on_two_threads)
    assert sets == 1
    assert resident < 5 * 2**20, resident


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s storage whose pages are resident (Linux ``mincore``)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    addr = t.untyped_storage().data_ptr()
    start = addr - addr % page
    pages = -(-(addr + t.untyped_storage().nbytes() - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(v & 1 for v in vec) * page


def _scratch_resident_after_a_dense_chunk() -> tuple[int, int, int, int]:
    """A fresh set of list outputs' resident bytes; detection of a chunk whose every element
    changed (the kernel writes the set's whole 10 MiB), checked; the set's resident bytes
    once it is back in the pool."""
    from deltasync.trainer import detect

    fresh = detect._ScratchBuffer(1 << 20, torch.int64, 0)
    untouched = _resident_bytes(fresh.tensor)
    n = 1 << 20
    p, before, tracker = _dense_chunk_stepped(n, seed=2)
    idx, vals = tracker.changed_values()["w"]
    moved = (p.detach().to(torch.bfloat16).view(torch.int16) != before.view(torch.int16)).sum()
    assert idx.numel() == n and int(moved) > n // 2  # the whole chunk flagged, most moved
    assert torch.equal(vals.view(torch.int16), p.detach().to(torch.bfloat16).view(torch.int16))
    (positions, values), *_ = detect._LISTS._free
    return untouched, _resident_bytes(positions.tensor), _resident_bytes(values.tensor), n


def test_list_outputs_keep_an_eighth_of_a_chunk_resident_after_a_dense_one() -> None:
    # On the C heap a set carved from pages an earlier allocation left resident was resident
    # whole (10 MiB in the 0.6B benchmark's trainer, written or not) and stayed so; in pages
    # of its own it holds what was written, and hands back all but the first eighth.
    untouched, positions, values, n = in_fresh_process(_scratch_resident_after_a_dense_chunk)
    assert untouched == 0
    assert positions <= n // 8 * 8 + 4096, positions  # 1 MiB of the 8 MiB written
    assert values <= n // 8 * 2 + 4096, values
