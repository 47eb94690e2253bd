"""What the device tier runs on: Python, torch and CUDA, the device, the native kernels, packages.

    python -m deltasync_bench.device_info      (scripts/gpu_tier.sh runs it first)

Prints a few lines and ends with one JSON line. Never fails for a missing package or device:
it reports them.
"""

from __future__ import annotations

import platform
import sys
from importlib import metadata

import torch

from deltasync_bench.common import emit_json

PACKAGES = (
    "numpy",
    "safetensors",
    "zstandard",
    "xxhash",
    "transformers",
    "pytest",
    "pytest-timeout",
)


def main() -> int:
    out: dict = {
        "bench": "device_info",
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
    }
    print(f"python {out['python']} ({sys.executable}), {out['machine']}")
    print(f"torch {out['torch']}, cuda {out['cuda']}, available {out['cuda_available']}")
    if torch.cuda.is_available():
        pr = torch.cuda.get_device_properties(0)
        out.update(
            device=pr.name, sms=pr.multi_processor_count, memory_gib=round(pr.total_memory / 2**30)
        )
        print(
            f"device {pr.name}, {pr.multi_processor_count} SMs, {pr.total_memory / 2**30:.0f} GiB"
        )
    try:
        from deltasync.native import loader

        built = loader.load() is not None
        why = None if built else str(getattr(loader, "build_error", "unknown"))
    except ImportError as exc:  # the loader moved or failed to import: say so, do not fail
        built, why = False, f"{type(exc).__name__}: {exc}"
    out.update(native_kernels=built, native_error=why)
    print(f"native C kernels (CPU only): {'built' if built else 'NOT built: ' + str(why)}")
    versions = {}
    for dist in PACKAGES:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
        print(f"  {dist} {versions[dist] or 'missing'}")
    out["packages"] = versions
    emit_json(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
