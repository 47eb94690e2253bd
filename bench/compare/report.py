"""Output of ``deltasync bench``: a table per path, a PNG plot, and the final JSON line."""

from __future__ import annotations

from deltasync_bench.common import print_table


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def table(path: str, results: dict[str, dict], model_bytes: int) -> None:
    rows = []
    d, s = results.get("dense"), results.get("snapshot")
    for name, r in results.items():
        vs_d = f"{d['total_s'] / r['total_s']:.1f}x" if d and r["total_s"] > 0 else "-"
        vs_s = f"{s['total_s'] / r['total_s']:.1f}x" if s and r["total_s"] > 0 else "-"
        rows.append(
            [
                name,
                f"{r['total_s']:.3f}",
                f"{r['trainer_stall_s']:.3f}",
                f"{r['transfer_s']:.3f}",
                f"{r['receiver_pause_s']:.3f}",
                _mib(r["bytes"]),
                f"{100 * r['trainer_overhead_bytes'] / model_bytes:.1f}%",
                f"{r['receiver_overhead_bytes'] / max(r['shard_bytes'], 1):.2f}x",
                vs_d,
                vs_s,
                "yes" if r["exact"] else "NO",
            ]
        )
    print_table(
        path,
        [
            "system",
            "total s",
            "stall s",
            "transfer s",
            "pause s",
            "MiB sent",
            "trainer +mem",
            "rx mem/shard",
            "vs dense",
            "vs snapshot",
            "exact",
        ],
        rows,
    )


def plot(results_by_path: dict[str, dict[str, dict]], out_png: str, title: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    paths = list(results_by_path)
    systems = sorted({s for r in results_by_path.values() for s in r})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(systems), 1)
    for i, sysname in enumerate(systems):
        xs = [j + i * width for j in range(len(paths))]
        axes[0].bar(
            xs,
            [results_by_path[p].get(sysname, {}).get("total_s", 0) for p in paths],
            width,
            label=sysname,
        )
        axes[1].bar(
            xs,
            [results_by_path[p].get(sysname, {}).get("bytes", 0) / 2**20 for p in paths],
            width,
            label=sysname,
        )
    for ax, ylabel in zip(axes, ["total seconds per sync (median)", "MiB moved per sync (median)"]):
        ax.set_xticks([j + width * (len(systems) - 1) / 2 for j in range(len(paths))])
        ax.set_xticklabels(paths, rotation=15, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_yscale("log")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png
