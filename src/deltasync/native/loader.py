"""Builds and loads the small C kernels in ``kernels/detect.c`` (detection, BF16 gather,
order check) with ctypes, and checks what they are handed.

The library is compiled on first use with the system C compiler into a private per-user cache
directory (``$XDG_CACHE_HOME/deltasync`` or ``~/.cache/deltasync``; mode 0700, owned by the
user, checked with ``lstat`` so a symlink or someone else's directory is never used), keyed by
the source hash, the flags and the machine, and written through the atomic write helper so
concurrent processes never load a half-written file. The SHA-256 of the built library is
recorded next to it and checked before every load; a mismatch rebuilds it. If no directory
passes the checks, the library is built into a fresh ``mkdtemp`` directory for this process.

If no compiler is available, :func:`load` returns ``None``, logs the reason and the remedy
once, and callers use the bit-identical torch implementation (~20x slower detection). A user
who wants the torch path anyway (to compare the two, or to rule the kernels out while
debugging) calls :func:`disable` (and :func:`enable` to undo it): an explicit call in the
process, not an environment variable, so the choice is visible in the code that makes it.

What a kernel may be handed is checked here too, before any raw pointer is taken: the kernels
read and write through ``data_ptr()`` with no bounds, stride or type checks of their own, so
every entry point (``native/ops.py``, ``trainer/detect.py``) asks :func:`kernel_ready` and the
``check_*`` functions first. A tensor is *kernel-ready* only if it is a plain dense CPU tensor
(exactly ``torch.Tensor`` or ``nn.Parameter``, never a subclass such as DTensor or a
fake/functional tensor), strided layout, not meta, contiguous (so its elements are one
non-overlapping run from ``data_ptr()``, whatever its storage offset), aligned for its dtype,
inside its storage, and without lazy conjugate/negative bits. Anything else either takes the
exact torch path (a strided view, a CUDA tensor, an expanded view) or, when no exact answer
exists (wrong dtype, disagreeing shapes, meta, sparse, a subclass), raises
:class:`~deltasync.errors.TensorInputError` naming the tensor; the checks read tensor metadata
only, never element values.

This module knows how to build and call the kernels; it knows nothing about optimizers.
"""

from __future__ import annotations

import bisect
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Iterable
from pathlib import Path

import torch

from deltasync.atomic import write_atomic
from deltasync.errors import TensorInputError

log = logging.getLogger(__name__)

_SRC = Path(__file__).with_name("kernels") / "detect.c"
# No -ffast-math: the error bound assumes IEEE semantics for every operation, in source order.
_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
if platform.machine() in ("x86_64", "AMD64"):
    # Full-width AVX-512 where the CPU has it (the compilers default to 256-bit vectors there):
    # one core's detection 1.27 -> 1.14 ns per element on a Xeon, close to what it reads from
    # memory; on CPUs without AVX-512 the option changes nothing. Same IEEE operations.
    _FLAGS.append("-mprefer-vector-width=512")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_disabled = False
build_error: str | None = None


class CacheDirError(RuntimeError):
    """A kernel cache directory failed the ownership/permission checks."""


def check_private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) if missing and check, with ``lstat``, that it is a real
    directory (not a symlink) owned by this user and not accessible to group or others.

    Raises:
        CacheDirError: naming the path and what is wrong with it.
    """
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise CacheDirError(f"{path}: {exc}") from exc
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise CacheDirError(f"{path} is not a plain directory (a symlink or a file)")
    if st.st_uid != os.getuid():
        raise CacheDirError(f"{path} is owned by uid {st.st_uid}, not by this user ({os.getuid()})")
    if st.st_mode & 0o077:
        try:  # ours, just too open (e.g. created under a lax umask before): tighten it
            os.chmod(path, 0o700)
        except OSError as exc:
            raise CacheDirError(
                f"{path} has mode {oct(st.st_mode & 0o777)} and cannot be made 0700"
            ) from exc
        if os.lstat(path).st_mode & 0o077:
            raise CacheDirError(f"{path} is still accessible to group/others")
    return path


def _cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path(os.path.expanduser("~")) / ".cache"
    try:
        return check_private_dir(base / "deltasync")
    except CacheDirError as exc:
        log.warning("native kernel cache %s; building into a private temporary directory", exc)
    # never a predictable shared-temp name: a fresh directory only this process knows
    return Path(tempfile.mkdtemp(prefix="deltasync-kernels-"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verified(out: Path, digest_file: Path) -> bool:
    """Whether ``out`` is a regular file of ours whose hash is the recorded one."""
    try:
        st = os.lstat(out)
        want = digest_file.read_text().strip()
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        return False
    return _sha256(out) == want


def _build() -> ctypes.CDLL:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc/clang) on PATH")
    src = _SRC.read_bytes()
    key = hashlib.sha256(
        src + " ".join(_FLAGS).encode() + platform.machine().encode() + platform.node().encode()
    )
    out = _cache_dir() / f"detect-{key.hexdigest()[:16]}.so"
    digest_file = out.with_name(out.name + ".sha256")
    for _attempt in range(3):  # another process may replace the file mid-check: rebuild
        if _verified(out, digest_file):
            break

        def compile_to(tmp: Path) -> None:
            subprocess.run(
                [cc, *_FLAGS, str(_SRC), "-o", str(tmp)], check=True, capture_output=True, text=True
            )
            os.chmod(tmp, 0o700)

        try:
            write_atomic(out, compile_to, durable=False)  # a lost cache file is rebuilt
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"compiling {_SRC.name} failed: {exc.stderr.strip()[:500]}") from exc
        write_atomic(digest_file, _sha256(out).encode(), durable=False)
    if not _verified(out, digest_file):
        raise RuntimeError(f"{out} does not match its recorded SHA-256 after 3 builds")
    lib = ctypes.CDLL(str(out))
    f, i64, p = ctypes.c_float, ctypes.c_int64, ctypes.c_void_p
    lib.ds_adamw_detect.argtypes = [p, p, p, i64, f, f, f, f, f, f, f, p]
    lib.ds_adamw_detect.restype = i64
    lib.ds_bits_count.argtypes = [p, i64]
    lib.ds_bits_count.restype = i64
    lib.ds_bits_to_indices.argtypes = [p, i64, i64, p]
    lib.ds_bits_to_indices.restype = i64
    lib.ds_adamw_detect_list.argtypes = [p, p, p, i64, f, f, f, f, f, f, f, i64, p, p]
    lib.ds_adamw_detect_list.restype = i64
    lib.ds_adamw_detect_list_many.argtypes = [i64, p, p, p, p, p, p, p, p, p]
    lib.ds_adamw_detect_list_many.restype = i64
    lib.ds_adamw_detect_list_cast.argtypes = [p, p, p, i64, f, f, f, f, f, f, f, i64, p, p, p]
    lib.ds_adamw_detect_list_cast.restype = i64
    lib.ds_gather_bf16.argtypes = [p, p, i64, p]
    lib.ds_gather_bf16.restype = i64
    lib.ds_cast_bf16.argtypes = [p, i64, p]
    lib.ds_cast_bf16.restype = i64
    lib.ds_gaps_encode.argtypes = [p, i64, i64, p, p]
    lib.ds_gaps_encode.restype = i64
    lib.ds_gaps_decode.argtypes = [p, i64, p, i64, p]
    lib.ds_gaps_decode.restype = i64
    lib.ds_cast_bf16_rows.argtypes = [p, i64, i64, i64, p]
    lib.ds_cast_bf16_rows.restype = i64
    lib.ds_first_not_increasing.argtypes = [p, i64]
    lib.ds_first_not_increasing.restype = i64
    for scatter in (lib.ds_scatter16_i32, lib.ds_scatter16_i64):
        scatter.argtypes = [p, i64, p, p, i64, i64]
        scatter.restype = i64
    for patch in (lib.ds_patch16_i32, lib.ds_patch16_i64):
        patch.argtypes = [p, p, i64, p, p, i64, i64]
        patch.restype = i64
    for prefix_sum in (lib.ds_prefix_sum_i32, lib.ds_prefix_sum_i64):
        prefix_sum.argtypes = [p, i64]
        prefix_sum.restype = i64
    lib.ds_column_block.argtypes = [p, i64, i64, i64, i64, i64, i64, i64, p, p]
    lib.ds_column_block.restype = i64
    lib.ds_planes_join.argtypes = [p, i64, i64, i64, p, p, i64, i64]
    lib.ds_planes_join.restype = i64
    lib.ds_decode_sparse.argtypes = [p, i64, i64, i64, i64, p, i64, p]
    lib.ds_decode_sparse.restype = i64
    lib.ds_patched_digests16.argtypes = [i64, p, p, p, p, p, p, p, i64, p, p]
    lib.ds_patched_digests16.restype = i64
    return lib


# The xxhash library's streaming XXH3-128 functions, in the order ds_patched_digests16 takes
# them. The xxhash package's extension module is that library compiled in, and exports its C
# API; a kernel that hashes calls it there, so the digest is the library's own.
_XXH3 = (
    "XXH3_createState",
    "XXH3_freeState",
    "XXH3_128bits_reset",
    "XXH3_128bits_update",
    "XXH3_128bits_digest",
)
_xxh3: tuple[int, ...] | None = None
_xxh3_tried = False


def xxh3_functions() -> tuple[int, ...] | None:
    """The addresses of the xxhash library's streaming XXH3-128 functions (see ``_XXH3``), or
    None where its extension module does not export them (the callers then hash in Python).
    The caller checks them against :mod:`xxhash`'s own digest before trusting them."""
    global _xxh3, _xxh3_tried
    with _lock:
        if not _xxh3_tried:
            _xxh3_tried = True
            try:
                import xxhash._xxhash as ext

                lib = ctypes.CDLL(ext.__file__)
                _xxh3 = tuple(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in _XXH3)
            except (ImportError, OSError, AttributeError) as exc:
                log.info("xxhash's C API is not reachable (%s): verify hashes in Python", exc)
                _xxh3 = None
        return _xxh3


def disable() -> None:
    """Run every kernel user of this process (detection, BF16 gathers, order checks) on the
    bit-identical torch path from now on, as if no compiler were installed.

    Results do not change (the two paths are bit-identical; tests compare them), only speed:
    detection is ~20x slower on CPU. Call it before building trackers when comparing the paths
    or ruling the kernels out; :func:`enable` undoes it.
    """
    global _disabled
    with _lock:
        if not _disabled:
            log.info("deltasync native kernels disabled by disable(): the torch path runs")
        _disabled = True


def enable() -> None:
    """Undo :func:`disable`: the kernels run again where they build (the next :func:`load`)."""
    global _disabled
    with _lock:
        _disabled = False


def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None if they cannot be built here (reason in ``build_error``,
    logged once with the remedy) or :func:`disable` was called.

    Returns:
        The loaded library, or None.
    """
    global _lib, _tried, build_error
    with _lock:
        if _disabled:
            return None
        if not _tried:
            _tried = True
            try:
                _lib = _build()
            except (RuntimeError, OSError) as exc:
                build_error = str(exc)
                _lib = None
                log.warning(
                    "deltasync native kernels unavailable (%s): change detection runs on the "
                    "exact torch path, ~20x slower on CPU. Remedy: install a C compiler "
                    "(e.g. apt-get install gcc) and make ~/.cache/deltasync writable, or set "
                    "XDG_CACHE_HOME to a private directory.",
                    build_error,
                )
        return _lib


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can take these tensors: every one kernel-ready (a plain, contiguous,
    aligned CPU tensor: see the checks below) and the library built here."""
    for t in tensors:  # a loop, not all() over a generator: asked several times per tensor
        if not kernel_ready(t):
            return False
    return load() is not None


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def describe(t: object) -> str:
    """A short description of ``t`` for error messages."""
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{type(t).__name__}(shape={tuple(t.shape)}, dtype={t.dtype}, device={t.device})"


def check_readable(
    name: str, t: object, *, dtypes: tuple[torch.dtype, ...] | None = None
) -> torch.Tensor:
    """Raise unless ``t`` is a tensor any exact path (C or torch) can read element by element.

    Args:
        name: what the tensor is, for the error message (e.g. ``"exp_avg of 'w'"``).
        t: the object handed in.
        dtypes: accepted dtypes (None: any).

    Returns:
        ``t``, typed as a tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TensorInputError(f"{name} must be a torch.Tensor, got {describe(t)}")
    if type(t) not in _PLAIN:
        hint = " (pass its local shard: .to_local())" if hasattr(t, "to_local") else ""
        raise TensorInputError(
            f"{name} is a tensor subclass {type(t).__name__}, which the detection kernels do "
            f"not read{hint}"
        )
    if t.layout != torch.strided:
        raise TensorInputError(f"{name} has layout {t.layout}; only dense (strided) tensors")
    if t.is_meta or t.device.type == "meta":
        raise TensorInputError(f"{name} is on the meta device and holds no values")
    outside = outside_storage(t)
    if outside is not None:
        raise TensorInputError(f"{name} {outside}; pass a tensor that holds its values")
    if dtypes is not None and t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise TensorInputError(f"{name} has dtype {t.dtype}; expected {want}")
    return t


def outside_storage(t: torch.Tensor) -> str | None:
    """Why ``t``'s elements do not all lie inside its storage (a storage freed or shrunk after
    the view was made: FSDP's resharding ``resize_(0)``, offloading), or None when they do.
    Every path that reads or writes ``t`` element by element needs this: the kernels read
    raw memory past the end, and torch fails untyped or writes past it too."""
    if t.numel() == 0 or t.is_meta:
        return None
    need = t.storage_offset() * t.element_size() + _extent(t)
    have = t.untyped_storage().nbytes()
    if need <= have:
        return None
    return (
        f"does not lie inside its storage: its view needs {need} bytes, the storage holds "
        f"{have} (freed or resized after the view was made, e.g. by FSDP's resharding or "
        "offloading)"
    )


def kernel_ready(t: torch.Tensor) -> bool:
    """Whether the C kernels can read ``t`` through its raw pointer (see the module doc).

    ``t`` must already have passed :func:`check_readable`; a False answer means: take the
    torch path."""
    if type(t) not in _PLAIN or not t.is_cpu or t.layout != torch.strided:
        return False
    if t.is_conj() or t.is_neg() or not t.is_contiguous():
        return False
    size = t.element_size()
    if t.numel() and t.data_ptr() % size:
        return False
    storage = t.untyped_storage()
    return (t.storage_offset() + t.numel()) * size <= storage.nbytes()


def check_same_shape(first: tuple[str, torch.Tensor], *others: tuple[str, torch.Tensor]) -> None:
    """Raise unless every tensor has the shape and device of the first (θ, m, v agreement)."""
    name0, t0 = first
    for name, t in others:
        if tuple(t.shape) != tuple(t0.shape):
            raise TensorInputError(
                f"{name} has shape {tuple(t.shape)} but {name0} has {tuple(t0.shape)}; they "
                "must agree element for element"
            )
        if t.device != t0.device:
            raise TensorInputError(f"{name} is on {t.device} but {name0} is on {t0.device}")


def check_bitset(
    name: str, bits: object, numel: int, device: torch.device | None = None
) -> torch.Tensor:
    """Raise unless ``bits`` is a 1-D uint8 tensor holding at least ``ceil(numel/8)`` bytes."""
    b = check_readable(name, bits, dtypes=(torch.uint8,))
    if b.dim() != 1:
        raise TensorInputError(f"{name} must be 1-D, got shape {tuple(b.shape)}")
    need = (numel + 7) // 8
    if b.numel() < need:
        raise TensorInputError(f"{name} holds {b.numel()} bytes; {numel} elements need {need}")
    if device is not None and b.device != device:
        raise TensorInputError(f"{name} is on {b.device}; the tensors it flags are on {device}")
    if b.numel() and b.stride(0) == 0 and b.numel() > 1:
        raise TensorInputError(
            f"{name} is an expanded view: its bytes overlap and cannot be written"
        )
    return b


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two CPU tensors intersect (conservative: by extent)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    a0 = a.data_ptr()
    b0 = b.data_ptr()
    a1 = a0 + _extent(a)
    b1 = b0 + _extent(b)
    return a0 < b1 and b0 < a1


def _extent(t: torch.Tensor) -> int:
    if t.is_contiguous():  # one run of numel elements (a kernel-ready tensor: the usual case)
        return t.numel() * t.element_size()
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride(), strict=True))
    return span * t.element_size()


def overlaps_itself(t: torch.Tensor) -> bool:
    """True unless the strides prove no two elements share memory (the usual sufficient test:
    sorted by stride, each stride exceeds the span of all smaller-stride dims)."""
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz > 1)
    span = 0  # largest offset reachable with the dims seen so far
    for stride, size in dims:
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def overlapping(items: Iterable[tuple[str, torch.Tensor, object]]) -> dict[str, str]:
    """``{name: another name}`` for every entry whose memory span intersects another's
    (conservative: by extent), from ``(name, tensor, owner)`` items; entries with equal
    ``owner`` (one tensor under two names) never count against each other."""
    items = list(items)
    return touching(items, items)


def touching(
    items: Iterable[tuple[str, torch.Tensor, object]],
    others: Iterable[tuple[str, torch.Tensor, object]],
) -> dict[str, str]:
    """``{name: a name of others}`` for every item whose memory span intersects the span of
    one of ``others`` with another ``owner`` (conservative: by extent); entries with equal
    owners (one tensor under two names, or an item and itself) never count."""
    spans: dict[str, list[tuple[int, int, object, str]]] = {}
    for name, t, owner in others:
        if t.numel() and t.device.type != "meta":
            start = t.data_ptr()
            spans.setdefault(str(t.device), []).append((start, start + _extent(t), owner, name))
    Reach = tuple[int, object, str]  # (end, owner, name)
    reach: dict[str, tuple[list[int], list[tuple[Reach, Reach | None]]]] = {}
    for device, found in spans.items():
        found.sort(key=lambda e: e[:2])
        # per prefix of the spans by start: the furthest-reaching one, and the furthest of
        # another owner than that one's
        best: list[tuple[Reach, Reach | None]] = []
        first: Reach | None = None
        second: Reach | None = None
        for _, end, owner, name in found:
            span = (end, owner, name)
            if first is None or end > first[0]:
                if first is not None and owner != first[1]:
                    second = first
                first = span
            elif owner != first[1] and (second is None or end > second[0]):
                second = span
            best.append((first, second))
        reach[device] = ([e[0] for e in found], best)
    out: dict[str, str] = {}
    for name, t, owner in items:
        if not t.numel() or t.device.type == "meta" or str(t.device) not in reach:
            continue
        starts, best = reach[str(t.device)]
        start = t.data_ptr()
        below = bisect.bisect_left(starts, start + _extent(t))  # the spans starting before its end
        if not below:
            continue
        first, second = best[below - 1]
        other = first if first[1] != owner else second
        if other is not None and other[0] > start:
            out[name] = other[2]
    return out


def _libc_trim() -> ctypes.CDLL | None:
    try:  # glibc only: malloc_trim is a GNU extension
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


_libc = _libc_trim()


def release_free_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim(0)``; a no-op
    elsewhere). A publish frees tens of MiB of short-lived buffers (routed indices, record
    sections, compressed segments) between long-lived ones (the captured positions), and glibc
    keeps such holes resident: on Qwen3-0.6B the trainer's RSS rose by ~60 MiB over a
    version that never held more than ~40 MiB at once. Freeing pages changes no object, only
    what the process keeps resident; a call costs up to ~1 ms here, plus the pages the next
    buffers fault in again (so it is not called for a small, inline version)."""
    if _libc is not None:
        _libc.malloc_trim(0)


# Routed changed elements between two releases of a publish's router. The heap's holes between
# releases are the trainer's memory peak: on Qwen3-0.6B (publish_probe --layers 28 --threads 1,
# 4 versions) the background's peak was 3.9-5.2% of the BF16 model releasing every 2^20
# elements and 3.0-4.5% every 2^18, for ~0.15 CPU s more per version (2.09 -> 2.24 s).
ROUTED_RELEASE_EVERY = 1 << 18


class HeapRelease:
    """Calls :func:`release_free_heap` once ``every`` units (routed changed elements, uploaded
    bytes) were counted since the last call: each release makes the next buffers fault their
    pages in again (so releasing after every small segment costs CPU), and never releasing
    let glibc keep ~40 MiB of holes on a 0.6B version."""

    def __init__(self, every: int = ROUTED_RELEASE_EVERY) -> None:
        self.every, self._count = every, 0

    def count(self, n: int) -> None:
        self._count += n
        if self._count >= self.every:
            release_free_heap()
            self._count = 0
