"""Output of ``deltasync bench``: a table per path, a PNG plot, and the final JSON line.

Every system's row shows, from one run: the trainer's overhead per step (wall time of a
training step with sync minus without), its detection alone, the sync latency (end of the
optimizer step -> every receiver verified), that latency against the floor (floor.py), bytes,
and the peak memory of each role above what it holds anyway.
"""

from __future__ import annotations

from deltasync_bench.common import print_table


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table(path: str, results: dict[str, dict], model_bytes: int, floor_s: float | None) -> None:
    rows = []
    d, s = results.get("dense"), results.get("snapshot")
    for name, r in results.items():
        vs_d = f"{d['total_s'] / r['total_s']:.1f}x" if d and r["total_s"] > 0 else "-"
        vs_s = f"{s['total_s'] / r['total_s']:.1f}x" if s and r["total_s"] > 0 else "-"
        ratio = r.get("latency_over_floor")
        rows.append(
            [
                name,
                f"{r['total_s']:.3f}",
                "-" if ratio is None else f"{ratio:.1f}x",
                f"{r['trainer_overhead_s']:.3f}",
                _s(r.get("detect_s")),
                f"{r['trainer_stall_s']:.3f}",
                f"{r['transfer_s']:.3f}",
                f"{r['receiver_pause_s']:.3f}",
                _mib(r["bytes"]),
                f"{100 * r['trainer_overhead_bytes'] / model_bytes:.1f}%",
                f"{r['receiver_peak_rss_bytes'] / 2**20:.0f}",
                f"{r['receiver_overhead_bytes'] / max(r['shard_bytes'], 1):.2f}x",
                _x(r.get("bootstrap_rx_mem_over_shard")),
                vs_d,
                vs_s,
                "yes" if r["exact"] else "NO",
            ]
        )
    print_table(
        f"{path} (floor {_s(floor_s)} s)",
        [
            "system",
            "latency s",
            "/ floor",
            "overhead s",
            "detect s",
            "blocked s",
            "transfer s",
            "pause s",
            "MiB sent",
            "trainer +mem",
            "rx peak MiB",
            "rx +mem/shard",
            "rx first pull",
            "vs dense",
            "vs snapshot",
            "exact",
        ],
        rows,
    )


_PANELS = (
    ("seconds per sync (median)", (("total_s", "latency"), ("trainer_overhead_s", "overhead"))),
    ("MiB moved per sync (median)", (("bytes", "sent"),)),
    (
        "MiB above model (+ optimizer) per role",
        (("trainer_overhead_bytes", "trainer"), ("receiver_overhead_bytes", "receiver")),
    ),
)


def plot(
    results_by_path: dict[str, dict[str, dict]],
    out_png: str,
    title: str,
    floors: dict[str, float] | None = None,
) -> str | None:
    """Time, bytes and memory per system and path, on linear axes (the floor as a mark)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    paths = list(results_by_path)
    systems = sorted({s for r in results_by_path.values() for s in r})
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(6 * len(_PANELS), 4.8))
    for ax, (ylabel, fields) in zip(axes, _PANELS, strict=False):
        bars = [(s, key, label) for s in systems for key, label in fields]
        width = 0.8 / max(len(bars), 1)
        for i, (sysname, key, label) in enumerate(bars):
            xs = [j + i * width for j in range(len(paths))]
            scale = 1.0 if key.endswith("_s") else 1 / 2**20
            ys = [results_by_path[p].get(sysname, {}).get(key, 0) * scale for p in paths]
            ax.bar(xs, ys, width, label=f"{sysname} {label}" if len(fields) > 1 else sysname)
        if floors and ylabel.startswith("seconds"):
            for j, p in enumerate(paths):
                if p in floors:
                    ax.hlines(
                        floors[p],
                        j - width / 2,
                        j + width * (len(bars) - 0.5),
                        colors="black",
                        linestyles="dashed",
                        label="floor" if j == 0 else None,
                    )
        ax.set_xticks([j + width * (len(bars) - 1) / 2 for j in range(len(paths))])
        ax.set_xticklabels(paths, rotation=15, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.axhline(0, color="gray", linewidth=0.5)  # linear axes; a negative overhead shows
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
