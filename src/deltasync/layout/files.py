"""Dense checkpoint files: a full HF checkpoint split into per-shard safetensors, and back.

``split_checkpoint`` reads a transformers ``config.json`` and a full bf16 checkpoint with
checkpoint-format (canonical) names (one ``.safetensors`` file, a sharded checkpoint's
``model.safetensors.index.json``, or a directory holding either), splits it with a
:class:`ReceiverLayout` (an engine's rules, or a probed layout file), and writes
``<out>/<shard id>.safetensors`` per distinct shard (the engine's local parameter names) plus
``<out>/shards.json`` (``[{"id", "tp_rank", "ep_rank"}, ...]``). ``merge_checkpoint`` is its
inverse: the shard files back into one full checkpoint, replicated copies checked bit for bit.
Each file is written to a temporary name and renamed, so a reader never sees half a file. A
split is one set of files, not only one file at a time: it removes an earlier listing before
its first shard file and writes its own last, and every shard file it writes carries the
split's id in its safetensors metadata (``deltasync_split``). A split that stops part-way over
an earlier one's directory leaves no listing, and ``merge`` refuses shard files of different
splits (a file without the id, e.g. one rewritten by hand, is not compared), so it never
joins two checkpoints into one that is neither.

The whole checkpoint is held in memory while splitting or merging (this serves anchors, dense
baselines and tests, not the sparse sync path). This module is the file I/O of
``deltasync.layout`` (probed layout files are read and written by ``probed``).

The JSON files a user names (``--config``, ``--layout``, a checkpoint index, ``shards.json``)
are read by :func:`deltasync.atomic.read_json`: only a regular file (a FIFO, a device such as
``/dev/zero`` or a directory is refused, never read), at most a capped size
(``MAX_CONFIG_BYTES`` = 4 MiB for a model config, ``MAX_JSON_BYTES`` = 256 MiB for the files
that grow with the model, ``probed.MAX_LAYOUT_BYTES`` likewise for layout files), strict UTF-8 JSON; anything else is a LayoutError naming the file.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from deltasync import names
from deltasync.atomic import process_umask, read_json, write_atomic
from deltasync.errors import LayoutError
from deltasync.layout.model_spec import ModelSpec
from deltasync.layout.receiver_layout import ReceiverLayout, ShardInfo

SHARDS_FILE = "shards.json"
SPLIT_KEY = "deltasync_split"  # safetensors metadata: the id of the split that wrote a shard file
INDEX_FILE = "model.safetensors.index.json"
# A transformers config.json is a few KiB (tens with a big label map); a bigger file is not one.
MAX_CONFIG_BYTES = 4 << 20
# Layout files, checkpoint indexes and shard listings grow with the model (a large MoE's layout
# file is tens of MiB); the cap only stops a runaway file from being read into memory whole.
MAX_JSON_BYTES = 256 << 20


def read_json_file(path: str | os.PathLike[str], *, limit: int, what: str, remedy: str) -> Any:
    """The JSON value in the regular file ``path``, else LayoutError naming it and ending with
    ``remedy`` (:func:`deltasync.atomic.read_json`: never blocks on a FIFO, never reads a
    device without end, refuses a binary file)."""
    return read_json(path, limit=limit, what=what, error=LayoutError, remedy=remedy)


def _is_dir(path: Path, what: str) -> bool:
    """Whether the user's ``path`` is a directory; a path that cannot be looked at (a name
    too long, no permission) is a LayoutError naming it, not an OSError traceback."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False  # read as a file next, and refused by name there
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte
        raise LayoutError(
            f"cannot read {what} {str(path)!r}: {getattr(exc, 'strerror', None) or exc}; pass "
            "a path that exists and that this user may read"
        ) from None


def load_config_dict(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A ``config.json`` as a dict (a directory means its ``config.json``)."""
    p = Path(path)
    if _is_dir(p, "model config"):
        p = p / "config.json"
    cfg = read_json_file(
        p,
        limit=MAX_CONFIG_BYTES,
        what="model config",
        remedy="pass the model's transformers config.json (or the directory holding it)",
    )
    if not isinstance(cfg, dict):
        raise LayoutError(
            f"model config {str(p)!r} is not a JSON object; pass the model's transformers "
            "config.json (or the directory holding it)"
        )
    return cfg


def load_config(path: str | os.PathLike[str]) -> ModelSpec:
    return ModelSpec.from_hf_config(load_config_dict(path))


def checkpoint_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a checkpoint given as a file, an index file or a directory.

    A directory with ``model.safetensors.index.json`` means the files its ``weight_map``
    names; a directory without one, every ``*.safetensors`` file in it.
    """
    p = Path(path)
    if _is_dir(p, "checkpoint"):
        if (p / SHARDS_FILE).exists():
            raise LayoutError(
                f"{str(p)!r} holds receiver shards ({SHARDS_FILE}), not a checkpoint: "
                "use 'deltasync layout merge' to rebuild the full checkpoint"
            )
        if (p / INDEX_FILE).exists():
            return _index_files(p / INDEX_FILE)
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise LayoutError(
                f"checkpoint directory {str(p)!r} has no .safetensors files; pass the directory "
                "the model was saved to with save_pretrained (safetensors weights), or one file"
            )
        return files
    if p.name.endswith(".index.json"):
        return _index_files(p)
    return [p]


def _index_files(index: Path) -> list[Path]:
    doc = read_json_file(
        index,
        limit=MAX_JSON_BYTES,
        what="checkpoint index",
        remedy="pass the index save_pretrained wrote, or the checkpoint's directory",
    )
    try:
        weight_map = doc["weight_map"]
        files = list(dict.fromkeys(str(v) for v in weight_map.values()))
    except (KeyError, TypeError, AttributeError) as exc:
        raise LayoutError(
            f"cannot read checkpoint index {str(index)!r}: {exc}; it must be a JSON object whose "
            '"weight_map" maps each tensor name to its .safetensors file, as save_pretrained '
            "writes it"
        ) from exc
    for n in files:
        if Path(n).name != n:
            raise LayoutError(
                f"checkpoint index {str(index)!r} names a file outside it: {n!r}; put the "
                "checkpoint's files next to the index and name them without a directory"
            )
    return [index.parent / n for n in files]


def _index_map(path: Path) -> dict[str, str] | None:
    index = path / INDEX_FILE if _is_dir(path, "checkpoint") else path
    if not index.name.endswith(".index.json") or not index.exists():
        return None
    return {
        str(k): str(v)
        for k, v in json.loads(index.read_text(encoding="utf-8"))["weight_map"].items()
    }


def load_canonical_checkpoint(
    path: str | os.PathLike[str], spec: ModelSpec
) -> dict[str, torch.Tensor]:
    """Read a full checkpoint (file, index or directory) and check it holds exactly the
    canonical bf16 tensors, each once, where its index says."""
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for f in checkpoint_files(path):
        part = _load_safetensors(f, "checkpoint")
        for name, t in part.items():
            if name in tensors:
                raise LayoutError(
                    f"checkpoint tensor {name!r} is in both {where[name]!r} and {f.name!r}; "
                    "remove the stray file, or pass the checkpoint's index to read only its files"
                )
            tensors[name], where[name] = t, f.name
    index = _index_map(Path(path))
    if index is not None:
        wrong = [n for n, f in index.items() if where.get(n) != f]
        if wrong or set(where) - set(index):
            n = (wrong or sorted(set(where) - set(index)))[0]
            raise LayoutError(
                f"checkpoint index {str(path)!r} does not match its files: {n!r} is in "
                f"{where.get(n)!r}, the index says {index.get(n)!r}; save the checkpoint again "
                "(save_pretrained) or fix the index's weight_map"
            )
    if spec.tie_word_embeddings:
        # Like vLLM's loader: with tied embeddings a checkpoint's lm_head.weight is skipped.
        tensors.pop("lm_head.weight", None)
    shapes = spec.canonical_shapes()
    missing = [n for n in shapes if n not in tensors]
    extra = [n for n in tensors if n not in shapes]
    if missing or extra:
        raise LayoutError(
            f"checkpoint {str(path)!r} does not match its config: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
            f"{' ...' if len(extra) > 5 else ''}; pass the config.json saved with this "
            "checkpoint"
        )
    for name, shape in shapes.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise LayoutError(
                f"checkpoint tensor {name!r} is {tuple(t.shape)}; the config says {shape}: "
                "pass the config.json saved with this checkpoint"
            )
        if t.dtype != spec.dtype:
            raise LayoutError(
                f"checkpoint tensor {name!r} is {t.dtype}; engines are synced in "
                f"{spec.dtype}, so the checkpoint must hold it (save the model cast to it, "
                f"e.g. model.to({spec.dtype}).save_pretrained(...))"
            )
    return tensors


def _load_safetensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path``, else LayoutError naming it. Only a
    regular file is opened: a FIFO would block the loader forever, a device read without end."""
    return _read_safetensors(path, what)[0]


# What to do when a safetensors file cannot be read, by what it was read as.
_REMEDY = {
    "checkpoint": "pass a .safetensors file, a model.safetensors.index.json or a directory "
    "holding them, as save_pretrained writes them",
    "shard file": "split the checkpoint again with 'deltasync layout split'",
}


def _read_safetensors(path: Path, what: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """:func:`_load_safetensors` with the file's metadata (empty when it has none)."""
    from safetensors import SafetensorError, safe_open

    try:
        kind = os.stat(path).st_mode
    except OSError as exc:
        raise LayoutError(
            f"cannot read {what} {str(path)!r}: {exc.strerror or exc}; {_REMEDY[what]}"
        ) from None
    if not stat.S_ISREG(kind):
        raise LayoutError(f"{what} {str(path)!r} is not a regular file; {_REMEDY[what]}")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = f.keys()  # a safe_open handle is not iterable
            return {k: f.get_tensor(k) for k in keys}, dict(f.metadata() or {})
    except (OSError, SafetensorError) as exc:
        raise LayoutError(f"cannot read {what} {str(path)!r}: {exc}; {_REMEDY[what]}") from exc


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # either missing (or unnameable): not one file
        return False


def _write_out(path: Path, write: Any, what: str) -> None:
    """``write_atomic(path, write)``, its failures a LayoutError naming ``path``.

    The file's mode is ``0666 & ~umask``, as a plain ``open`` would make it: the shard files
    and the merged checkpoint are read by engines that may run as another user
    (``safetensors.save_file`` alone leaves them 0600)."""
    umask = process_umask()
    try:
        write_atomic(path, write, mode=0o666 & ~umask, over_files_only=True)
    except Exception as exc:  # a device or directory there, no such parent, a full disk
        why = getattr(exc, "strerror", None) or f"{type(exc).__name__}: {exc}"
        raise LayoutError(
            f"cannot write {what} {str(path)!r} ({why}); pass an --out this command may "
            "create or replace"
        ) from exc


def _layout(
    spec: ModelSpec, engine: str, tp: int, ep: int, layout_file: str | os.PathLike[str] | None
) -> ReceiverLayout:
    if layout_file is None:
        return ReceiverLayout.build(spec, engine, tp, ep)
    from deltasync.layout.probed import load_layout

    table, shards, key = load_layout(layout_file)
    if table.src_shapes != spec.canonical_shapes():
        raise LayoutError(
            f"layout file {str(layout_file)!r} was made for other tensors than this config's; "
            "pass the config it was probed from, or probe this config with "
            "`deltasync layout probe --config ... --out ...`"
        )
    parallel = key.get("parallel", {})
    if not isinstance(parallel, dict):
        raise LayoutError(
            f"layout file {str(layout_file)!r}: its key is not a layout key (write the file "
            "again with `deltasync layout probe`)"
        )
    sizes = {}
    for field, ranks in (("tp", [s.tp_rank for s in shards]), ("ep", [s.ep_rank for s in shards])):
        size = parallel.get(field)
        if size is None:
            size = 1 + max(ranks, default=0)
        if type(size) is not int or size <= max(ranks, default=0):
            raise LayoutError(
                f"layout file {str(layout_file)!r}: key.parallel.{field} is {size!r}, not a "
                f"size above every shard's {field} rank (write the file again with "
                "`deltasync layout probe`)"
            )
        sizes[field] = size
    return ReceiverLayout(
        spec=spec,
        engine=str(key.get("engine", "probed")),
        tp=sizes["tp"],
        ep=sizes["ep"],
        table=table,
        shards=shards,
    )


def split_checkpoint(
    *,
    config: str | os.PathLike[str],
    checkpoint: str | os.PathLike[str],
    engine: str,
    tp: int,
    ep: int,
    out: str | os.PathLike[str],
    layout_file: str | os.PathLike[str] | None = None,
) -> list[ShardInfo]:
    """Write one safetensors file per distinct receiver shard and ``shards.json``.

    Args:
        config: the model's ``config.json`` (or its directory).
        checkpoint: a ``.safetensors`` file, a ``model.safetensors.index.json`` or a directory.
        engine, tp, ep: the receiver convention (ignored with ``layout_file``).
        out: the output directory.
        layout_file: a probed layout (``deltasync layout probe``) to split by instead.

    Returns:
        The shards written.
    """
    from safetensors.torch import save_file

    spec = load_config(config)
    layout = _layout(spec, engine, tp, ep, layout_file)
    full = load_canonical_checkpoint(checkpoint, spec)
    shards = layout.split(full)
    del full
    out_dir = Path(out)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file there, or under a file
        raise LayoutError(
            f"cannot create the output directory {str(out_dir)!r}: {exc.strerror or exc}; pass "
            "a directory (created if missing)"
        ) from None
    try:  # an earlier split's listing must not name this one's files while they are written
        (out_dir / SHARDS_FILE).unlink(missing_ok=True)
    except OSError as exc:
        raise LayoutError(
            f"cannot remove the earlier shard listing {str(out_dir / SHARDS_FILE)!r}: "
            f"{exc.strerror or exc}; nothing was written"
        ) from None
    split = secrets.token_hex(8)
    for info in layout.shards():
        tensors = {n: t.contiguous() for n, t in shards.pop(info.id).items()}
        target = out_dir / f"{info.id}.safetensors"
        metadata = {"format": "pt", SPLIT_KEY: split, names.META_SHARD: info.id}
        _write_out(target, lambda p, t=tensors, m=metadata: save_file(t, str(p), m), "shard file")
    listing = json.dumps([s.to_json() for s in layout.shards()], indent=1) + "\n"
    _write_out(
        out_dir / SHARDS_FILE, lambda p: p.write_text(listing, encoding="utf-8"), "shard listing"
    )
    return layout.shards()


def _read_listing(shards_dir: Path) -> list[ShardInfo]:
    listing = read_json_file(
        shards_dir / SHARDS_FILE,
        limit=MAX_JSON_BYTES,
        what="shard listing",
        remedy="pass a directory 'deltasync layout split' wrote, or split the checkpoint again",
    )
    try:
        shards = [ShardInfo(str(e["id"]), int(e["tp_rank"]), int(e["ep_rank"])) for e in listing]
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise LayoutError(
            f"cannot read {str(shards_dir / SHARDS_FILE)!r}: {exc}; pass a directory "
            "'deltasync layout split' wrote, or split the checkpoint again"
        ) from exc
    if not shards:
        raise LayoutError(
            f"{str(shards_dir / SHARDS_FILE)!r} lists no shard; pass a directory "
            "'deltasync layout split' wrote, or split the checkpoint again"
        )
    return shards


def merge_checkpoint(
    *,
    config: str | os.PathLike[str],
    shards_dir: str | os.PathLike[str],
    engine: str,
    out: str | os.PathLike[str],
    layout_file: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """The inverse of :func:`split_checkpoint`: shard files back into one full checkpoint.

    TP and EP sizes come from ``shards.json``; replicated elements (norms, kv heads, attention
    under EP) must agree bit for bit across shards, and the shard files must hold exactly the
    layout's tensors, else LayoutError naming the tensor.

    Args:
        config: the model's ``config.json`` (or its directory).
        shards_dir: a directory :func:`split_checkpoint` wrote.
        engine: the receiver convention the shards are in (ignored with ``layout_file``).
        out: the full checkpoint to write (one ``.safetensors`` file, canonical names).
        layout_file: a probed layout the shards were split by.

    Returns:
        ``{"tensors": count, "elements": count, "shards": [ids]}``.
    """
    from safetensors.torch import save_file

    spec = load_config(config)
    src = Path(shards_dir)
    listing = _read_listing(src)
    tp = 1 + max(s.tp_rank for s in listing)
    ep = 1 + max(s.ep_rank for s in listing) if any("-ep" in s.id for s in listing) else 1
    try:
        layout = _layout(spec, engine, tp, ep, layout_file)
    except LayoutError as exc:
        if layout_file is not None:
            raise
        # merge takes no --tp/--ep: the sizes are the split's, so the engine is what is wrong
        raise LayoutError(
            f"{str(src / SHARDS_FILE)!r} lists {len(listing)} shard(s) (tp={tp} ep={ep}), "
            f"which engine {engine!r} cannot hold ({str(exc).split(';')[0]}); pass the "
            "--engine or --layout the shards were split with"
        ) from None
    if [s.id for s in layout.shards()] != [s.id for s in listing]:
        raise LayoutError(
            f"{str(src / SHARDS_FILE)!r} lists shards {[s.id for s in listing]}; "
            f"the {layout.engine} layout at tp={tp} ep={ep} has {[s.id for s in layout.shards()]}; "
            "pass the --engine or --layout the shards were split with"
        )
    inputs = [src / f"{s.id}.safetensors" for s in listing]
    if any(_same_file(Path(out), p) for p in inputs):
        raise LayoutError(
            f"--out {str(out)!r} is one of the shard files it merges; pass another path"
        )
    shards: dict[str, Mapping[str, torch.Tensor]] = {}
    splits: dict[str, str | None] = {}
    for s, path in zip(listing, inputs, strict=True):
        shards[s.id], metadata = _read_safetensors(path, "shard file")
        splits[s.id] = metadata.get(SPLIT_KEY)
        held = metadata.get(names.META_SHARD, s.id)  # files split before it was recorded: s.id
        if held != s.id:  # another TP rank's file has the same names and shapes
            raise LayoutError(
                f"shard file {str(path)!r} holds shard {held[:64]!r}, not {s.id!r}: the files "
                "were renamed or copied over each other. Put each file back under its own "
                "shard's name, or split the checkpoint again; nothing was written"
            )
    if len({split for split in splits.values() if split is not None}) > 1:
        raise LayoutError(
            f"the shard files in {str(src)!r} come from different splits ({SPLIT_KEY} "
            f"{splits}): a split stopped part-way over an earlier one, or files were copied "
            "in from elsewhere. Split the checkpoint again into an empty directory"
        )
    full = {n: t.contiguous() for n, t in layout.merge(shards).items()}
    _write_out(
        Path(out), lambda p: save_file(full, str(p), metadata={"format": "pt"}), "merged checkpoint"
    )
    return {
        "tensors": len(full),
        "elements": sum(t.numel() for t in full.values()),
        "shards": [s.id for s in listing],
    }
