"""Small helpers shared by the benchmark programs: timing, memory bandwidth, RSS, output."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from typing import Any

import torch

from deltasync.commands.apps import emit_json_line


def timed(fn: Callable[[], Any], repeat: int = 1) -> tuple[float, Any]:
    """Best wall time over ``repeat`` runs (seconds) and the last result."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def memory_read_gbps(nbytes: int = 1 << 30, repeat: int = 3) -> float:
    """STREAM-like read bandwidth: a reduction over a large fp32 buffer, all torch threads."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()  # fault pages in
    t, _ = timed(lambda: x.sum(), repeat)
    return nbytes / t / 1e9


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for h in header:
            table.add_column(h, justify="right" if h != header[0] else "left")
        for r in rows:
            table.add_row(*[str(c) for c in r])
        Console(width=200).print(table)
    except ImportError:  # rich is a dependency, but a table must never be why a bench fails
        print(title)
        print(" | ".join(header))
        for r in rows:
            print(" | ".join(str(c) for c in r))


def qwen3_config(*, layers: int, hidden: int, vocab: int) -> dict:
    """A config-built Qwen3 of ``layers`` decoder layers and ``hidden`` width (heads of 64,
    half as many KV heads, an MLP three times as wide): the benchmarks' sized models."""
    from deltasync_examples.models import tiny_qwen3

    heads = hidden // 64
    return tiny_qwen3(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        intermediate_size=3 * hidden,
        vocab_size=vocab,
    )


def emit_json(obj: dict) -> None:
    """The last stdout line of every benchmark."""
    emit_json_line(obj, sort_keys=True)
