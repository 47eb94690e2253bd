"""Throughput of the wire format on a ~100M-element BF16 tensor set with 1% of elements changed.

A program, not a test: ``python -m deltasync_bench.format_bench``.
Prints a table, checks that the receiver ends bit-identical to the source, and ends with one
JSON line. Compare the MB/s columns with this machine's memory bandwidth (~12 GB/s read) and
with zstd level 1 alone (the "zstd only" rows time the same bytes through zstandard directly).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import zstandard

from deltasync.format import (
    TensorSpec,
    apply_updates,
    decode_blob,
    encode_blob,
    full_updates,
    sparse_update,
)


def best_of(repeats: int, fn):
    best, out = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--elements", type=int, default=100_000_000)
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dense", action="store_true", help="also time a dense anchor blob")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(0)
    per = args.elements // args.tensors
    shapes = {f"layers.{k}.w": (per // 1024, 1024) for k in range(args.tensors)}
    old = {n: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for n, s in shapes.items()}
    new, changed = {}, {}
    for n, t in old.items():
        idx = torch.randperm(t.numel(), generator=g)[: int(t.numel() * args.density)].sort().values
        upd = t.clone()
        flat = upd.view(-1)
        flat[idx] = (flat[idx].float() + 1e-4).to(torch.bfloat16)
        new[n], changed[n] = upd, idx
    numel = sum(t.numel() for t in old.values())
    nnz = sum(i.numel() for i in changed.values())

    t_build, updates = best_of(
        args.repeats, lambda: [sparse_update(n, new[n], changed[n]) for n in new]
    )
    head = dict(version=2, base_version=1, shard="tp0", writer="w00000")
    t_enc, blob = best_of(args.repeats, lambda: encode_blob(updates, **head))
    spec = {n: TensorSpec(shape=tuple(t.shape), dtype=t.dtype) for n, t in old.items()}
    t_dec, decoded = best_of(
        args.repeats, lambda: decode_blob(blob, expected=spec, version=2, base_version=1)
    )
    live = {n: t.clone() for n, t in old.items()}
    t_apply, written = best_of(args.repeats, lambda: apply_updates(decoded.updates, live))
    exact = written == nnz and all(
        torch.equal(live[n].view(torch.int16), new[n].view(torch.int16)) for n in new
    )
    raw_bytes = nnz * 2  # values alone, the payload a perfect index coder would add nothing to
    int32_bytes = nnz * 6  # raw int32 index + bf16 value

    # zstd alone on the same decompressed section, for the ceiling of the codec's own work.
    level0 = encode_blob(updates, **head, level=0)
    section = level0[48 + 3 + 6 : -16]
    t_zc, z = best_of(args.repeats, lambda: zstandard.ZstdCompressor(level=1).compress(section))
    t_zd, _ = best_of(args.repeats, lambda: zstandard.ZstdDecompressor().decompress(z))

    rows = [
        ("build (sparse_update)", t_build, len(blob)),
        ("encode_blob", t_enc, len(blob)),
        ("decode_blob (validated)", t_dec, len(blob)),
        ("apply_updates", t_apply, len(blob)),
        ("zstd only: compress", t_zc, len(z)),
        ("zstd only: decompress", t_zd, len(z)),
    ]
    result = {
        "torch_threads": torch.get_num_threads(),
        "elements": numel,
        "changed": nnz,
        "blob_bytes": len(blob),
        "section_raw_bytes": len(section),
        "bytes_per_changed_element": len(blob) / nnz,
        "ratio_vs_int32_index_plus_bf16": int32_bytes / len(blob),
        "dense_bf16_bytes": numel * 2,
        "exact": exact,
    }
    if args.dense:
        anchor = full_updates(new)
        t_aenc, ablob = best_of(
            1, lambda: encode_blob(anchor, version=2, base_version=-1, shard="tp0", writer="w00000")
        )
        t_adec, adec = best_of(1, lambda: decode_blob(ablob, expected=spec))
        fresh = {n: torch.empty_like(t) for n, t in old.items()}
        t_aapp, _ = best_of(1, lambda: apply_updates(adec.updates, fresh))
        result["anchor_bytes"] = len(ablob)
        result["anchor_exact"] = all(
            torch.equal(fresh[n].view(torch.int16), new[n].view(torch.int16)) for n in new
        )
        rows += [
            ("anchor encode_blob", t_aenc, len(ablob)),
            ("anchor decode_blob", t_adec, len(ablob)),
            ("anchor apply_updates", t_aapp, len(ablob)),
        ]

    print(
        f"{numel:,} bf16 elements in {len(shapes)} tensors, {nnz:,} changed "
        f"({args.density:.1%}); blob {len(blob):,} B = {len(blob) / nnz:.2f} B/changed "
        f"element (raw values alone {raw_bytes:,} B, int32 idx + bf16 {int32_bytes:,} B)"
    )
    print(f"{'stage':26s} {'ms':>9s} {'MB/s of blob':>13s} {'M elem/s':>10s}")
    for name, t, size in rows:
        elems = numel if name.startswith("anchor") else nnz
        print(f"{name:26s} {t * 1e3:9.1f} {size / t / 1e6:13.0f} {elems / t / 1e6:10.1f}")
        result[name] = {"ms": round(t * 1e3, 2), "blob_MB_per_s": round(size / t / 1e6, 1)}
    exact = exact and result.get("anchor_exact", True)  # --dense: the anchor must be exact too
    result["exact"] = exact
    print("exact:", "yes" if exact else "NO")
    print(json.dumps(result))
    if not exact:
        raise SystemExit("receiver state differs from the source")


if __name__ == "__main__":
    main()
