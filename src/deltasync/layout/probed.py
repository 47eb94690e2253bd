"""Probed layouts as data: receiver layouts learned per shard, saved as JSON, cached.

``probe_receiver_layout(spec, make_loader, ...)`` probes every distinct receiver shard's own
loader (one shard's model alive at a time) and joins them into a :class:`ReceiverLayout` whose
table is the same type the hand-written rules build, so routing, split/merge, digests and the
receivers' checks run unchanged; ``probe_engine_layout`` does it for the engines this process
can build from a ``config.json`` dict (the CLI's entry point).

``layout_to_json`` / ``layout_from_json`` write and read a table with its shard list and the
key it was probed for (model config, engine, parallel config): the file ``deltasync layout
probe`` prints, that a user inspects, caches and ships to receivers. ``ProbeCache`` keeps one
such file per key digest in a directory, so the probe runs once per (model config, engine,
parallel config).

This module knows tables, blocks and JSON; it does not drive loaders (``probe``) and knows no
model family.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from deltasync.atomic import read_json, write_atomic
from deltasync.errors import LayoutError
from deltasync.format.updates import check_shape
from deltasync.layout.blocks import Block
from deltasync.layout.hf_model import require_transformers
from deltasync.layout.probe import ProbeConfig, ShardProbe, probe_shard
from deltasync.layout.probe_blocks import assemble_table
from deltasync.layout.receiver_layout import ReceiverLayout, ShardInfo
from deltasync.layout.table import LayoutTable, Placement, Shape
from deltasync.names import shard_id

log = logging.getLogger(__name__)

# What to do about a layout file that cannot be read as one.
_REWRITE = "write the file again with `deltasync layout probe`"

LAYOUT_FORMAT = "deltasync-layout"
LAYOUT_FORMAT_VERSION = 1
# Bumped when what the probe computes changes, so stale cache entries are not reused.
PROBE_VERSION = 1
# A large MoE's layout file is tens of MiB; the cap only stops a runaway file from being read
# into memory whole.
MAX_LAYOUT_BYTES = 256 << 20


def probe_key(
    model_config: Mapping[str, Any], engine: str, parallel: Mapping[str, Any]
) -> dict[str, Any]:
    """The identity of a probe: what it was run for, in a JSON-able, order-free form."""
    return {
        "model_config": json.loads(json.dumps(dict(model_config), sort_keys=True, default=str)),
        "engine": engine,
        "parallel": dict(sorted(parallel.items())),
        "probe_version": PROBE_VERSION,
    }


def key_digest(key: Mapping[str, Any]) -> str:
    raw = json.dumps(key, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(raw).hexdigest()[:32]


# ---------------------------------------------------------------------- JSON


def _block_row(p: Placement) -> list[Any]:
    b = p.block
    return [
        p.shard,
        p.local,
        b.src_cols,
        b.dst_cols,
        b.src_row,
        b.dst_row,
        b.rows,
        b.src_col,
        b.dst_col,
        b.cols,
    ]


def layout_to_json(
    table: LayoutTable, shards: Sequence[ShardInfo], key: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A table and its shard list as a JSON object (see :func:`layout_from_json`)."""
    return {
        "format": LAYOUT_FORMAT,
        "format_version": LAYOUT_FORMAT_VERSION,
        "key": dict(key or {}),
        "shards": [{"id": s.id, "tp_rank": s.tp_rank, "ep_rank": s.ep_rank} for s in shards],
        "canonical": {n: list(s) for n, s in table.src_shapes.items()},
        "locals": {sid: {n: list(s) for n, s in m.items()} for sid, m in table.dst_shapes.items()},
        "aliases": {sid: dict(a) for sid, a in table.aliases.items() if a},
        "placements": {n: [_block_row(p) for p in pls] for n, pls in table.placements.items()},
    }


def _shape(value: Any, what: str) -> Shape:
    if not isinstance(value, list):
        raise LayoutError(
            f"layout file: {what} must be a list of non-negative integers; {_REWRITE}"
        )
    return check_shape(value, f"layout file: {what}", LayoutError)


def layout_from_json(doc: Mapping[str, Any]) -> tuple[LayoutTable, list[ShardInfo], dict[str, Any]]:
    """Read what :func:`layout_to_json` wrote; the table is validated as any table is.

    Returns:
        ``(table, shards, key)``.

    Raises:
        LayoutError: not a layout file, a malformed field (named), or an invalid table.
    """
    if not isinstance(doc, Mapping) or doc.get("format") != LAYOUT_FORMAT:
        raise LayoutError(
            f"not a deltasync layout file (format is not {LAYOUT_FORMAT!r}); pass a file "
            "`deltasync layout probe --out` wrote"
        )
    if doc.get("format_version") != LAYOUT_FORMAT_VERSION:
        raise LayoutError(
            f"layout file format_version {doc.get('format_version')!r} is not supported "
            f"(this deltasync reads {LAYOUT_FORMAT_VERSION}); re-run deltasync layout probe"
        )
    try:
        shards = [
            ShardInfo(str(s["id"]), int(s["tp_rank"]), int(s["ep_rank"])) for s in doc["shards"]
        ]
        canonical = {str(n): _shape(s, f"canonical[{n!r}]") for n, s in doc["canonical"].items()}
        locals_ = {
            str(sid): {str(n): _shape(s, f"locals[{sid!r}][{n!r}]") for n, s in m.items()}
            for sid, m in doc["locals"].items()
        }
        aliases = {
            str(sid): {str(a): str(t) for a, t in m.items()}
            for sid, m in doc.get("aliases", {}).items()
        }
        placements: dict[str, list[Placement]] = {}
        for name, rows in doc["placements"].items():
            for row in rows:
                if len(row) != 10 or not all(isinstance(x, int) for x in row[2:]):
                    raise LayoutError(
                        f"layout file: a placement of {name!r} is malformed: {row!r}; {_REWRITE}"
                    )
                sid, local, *nums = row
                sc, dc, sr, dr, r, scol, dcol, c = nums
                if min(nums) < 0 or scol + c > sc or dcol + c > dc:
                    raise LayoutError(
                        f"layout file: a block of {name!r} is out of range: {row!r}; {_REWRITE}"
                    )
                block = Block(
                    src_cols=sc,
                    dst_cols=dc,
                    src_row=sr,
                    dst_row=dr,
                    rows=r,
                    src_col=scol,
                    dst_col=dcol,
                    cols=c,
                )
                placements.setdefault(str(name), []).append(Placement(str(sid), str(local), block))
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise LayoutError(
            f"layout file is malformed: {type(exc).__name__}: {exc}; {_REWRITE}"
        ) from exc
    ids = [s.id for s in shards]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise LayoutError(
            f"layout file: 'shards' lists shard id(s) {twice} more than once; each shard is "
            "listed once (write the file again with `deltasync layout probe`, or fix it by hand)"
        )
    if set(ids) != set(locals_):
        raise LayoutError(f"layout file: 'shards' and 'locals' name different shards; {_REWRITE}")
    table = LayoutTable(
        src_shapes=canonical, dst_shapes=locals_, placements=placements, aliases=aliases
    )
    key = doc.get("key", {})
    if not isinstance(key, dict):
        raise LayoutError(
            f"layout file: 'key' is a {type(key).__name__}, not an object; {_REWRITE}"
        )
    return table, shards, dict(key)


def save_layout(
    path: str | os.PathLike[str],
    table: LayoutTable,
    shards: Sequence[ShardInfo],
    key: Mapping[str, Any] | None = None,
) -> None:
    """Write the layout file atomically.

    The path is the user's (``--out``, a cache directory): an OSError of the write (a parent
    that is a file or missing, a directory in the file's place, no permission) is a LayoutError
    naming it. ``write_atomic`` removes its temporary file on failure, so nothing is left.
    """
    text = json.dumps(layout_to_json(table, shards, key), indent=1) + "\n"
    try:
        write_atomic(path, text.encode(), durable=False, over_files_only=True)
    except OSError as exc:
        raise LayoutError(
            f"cannot write layout file {str(path)!r}: {exc.strerror or exc}; pass a file path "
            "in an existing, writable directory"
        ) from None


def load_layout(
    path: str | os.PathLike[str],
) -> tuple[LayoutTable, list[ShardInfo], dict[str, Any]]:
    """Read a layout file; only a regular file of at most ``MAX_LAYOUT_BYTES`` is read (see
    :func:`~deltasync.atomic.read_json`): ``--layout`` may name anything.

    Raises:
        LayoutError: unreadable, or not a valid layout file (the message names the file)."""
    doc = read_json(
        path,
        limit=MAX_LAYOUT_BYTES,
        what="layout file",
        error=LayoutError,
        remedy="pass a file `deltasync layout probe --out` wrote",
    )
    try:
        return layout_from_json(doc)
    except LayoutError as exc:
        raise LayoutError(f"layout file {str(path)!r}: {exc}") from None


def save_receiver_layout(
    path: str | os.PathLike[str], layout: ReceiverLayout, key: Mapping[str, Any] | None = None
) -> None:
    """Write a receiver layout's table and shards as a layout file (atomically)."""
    save_layout(path, layout.table, layout.shards(), key)


def load_receiver_layout(
    path: str | os.PathLike[str], spec: Any, *, engine: str = "vllm"
) -> ReceiverLayout:
    """A :class:`ReceiverLayout` from a layout file, for the model ``spec`` describes.

    Args:
        path: a file :func:`save_layout` / ``deltasync layout probe`` wrote.
        spec: the model's :class:`~deltasync.layout.model_spec.ModelSpec`.
        engine: the convention's name, recorded in manifests (publisher and receivers must
            agree on it; the placements themselves are part of the manifests' layout record).

    Raises:
        LayoutError: not a layout file, or one made for other tensors than ``spec``'s.
    """
    table, shards, _ = load_layout(path)
    if table.src_shapes != spec.canonical_shapes():
        raise LayoutError(
            f"layout file {str(path)!r} was made for other tensors than this "
            f"{spec.model_type!r} config's: probe the engine for this model"
        )
    tp = 1 + max(s.tp_rank for s in shards)
    ep = 1 + max(s.ep_rank for s in shards)
    return ReceiverLayout(spec=spec, engine=engine, tp=tp, ep=ep, table=table, shards=shards)


# ---------------------------------------------------------------------- cache


class ProbeCache:
    """One layout file per probe key under ``root`` (``<key digest>.json``).

    ``root`` is created on the first ``put``; a path that can never be a directory (a file
    there or in its parents) is refused when the cache is made, before a probe that may take
    minutes is run only to find its result cannot be kept.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser()  # "~/.cache/...": the user's, not ./~
        try:
            st = os.stat(self.root)
        except FileNotFoundError:
            return  # created by put
        except OSError as exc:  # ENOTDIR: a parent is a file; EACCES
            raise LayoutError(
                f"probe cache directory {str(self.root)!r} cannot be used: {exc.strerror}; "
                "pass a directory (it is created if missing)"
            ) from None
        if not stat.S_ISDIR(st.st_mode):
            raise LayoutError(
                f"probe cache directory {str(self.root)!r} is not a directory: pass a "
                "directory (it is created if missing)"
            )

    def path(self, key: Mapping[str, Any]) -> Path:
        return self.root / f"{key_digest(key)}.json"

    def get(self, key: Mapping[str, Any]) -> tuple[LayoutTable, list[ShardInfo]] | None:
        """The cached layout for ``key``, or None. A file whose stored key differs, or that
        cannot be read as a layout file (damaged, or written by another release), is ignored:
        the layout is probed again and the entry replaced."""
        p = self.path(key)
        if not p.exists():
            return None
        try:
            table, shards, stored = load_layout(p)
        except LayoutError as exc:
            log.warning("probe cache: %s; probing again", exc)
            return None
        if stored != json.loads(json.dumps(dict(key))):
            log.warning("probe cache: %s holds another key; probing again", p)
            return None
        return table, shards

    def put(self, key: Mapping[str, Any], table: LayoutTable, shards: Sequence[ShardInfo]) -> Path:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LayoutError(
                f"cannot create probe cache directory {str(self.root)!r}: {exc.strerror or exc}; "
                "pass a directory (it is created if missing)"
            ) from None
        p = self.path(key)
        save_layout(p, table, shards, key)
        return p

    def get_or_probe(
        self,
        key: Mapping[str, Any],
        probe: Callable[[], tuple[LayoutTable, Sequence[ShardInfo]]],
    ) -> tuple[LayoutTable, list[ShardInfo]]:
        """The cached layout, or ``probe()``'s result, stored for next time."""
        hit = self.get(key)
        if hit is not None:
            log.info("probe cache hit: %s", self.path(key))
            return hit
        table, shards = probe()
        self.put(key, table, shards)
        return table, list(shards)


# ---------------------------------------------------------------------- receiver layouts


def probe_receiver_layout(
    spec: Any,
    make_loader: Callable[[int, int], Any],
    *,
    engine: str,
    tp: int = 1,
    ep: int = 1,
    config: ProbeConfig | None = None,
    cache: ProbeCache | None = None,
    model_config: Mapping[str, Any] | None = None,
) -> ReceiverLayout:
    """A :class:`ReceiverLayout` learned from every distinct shard's own loader.

    Args:
        spec: the model's :class:`~deltasync.layout.model_spec.ModelSpec` (canonical tensors).
        make_loader: ``(tp_rank, ep_rank) -> loader`` building one shard's engine model (see
            :func:`~deltasync.layout.probe.probe_shard`); each is dropped after its probe, so
            one shard's model is alive at a time.
        engine: the convention's name, recorded in the layout and the cache key.
        tp, ep: tensor- and expert-parallel sizes; shards are named as vLLM's (``tp{r}`` or
            ``tp{r}-ep{e}`` with attention TP rank ``e % tp``).
        config: probe settings.
        cache: where probed layouts are kept per (model config, engine, parallel config).
        model_config: the key's model config (default: the spec's fields).

    Returns:
        The layout; its table is what the loaders did, validated like any table.
    """
    for name, v in (("tp", tp), ("ep", ep)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise LayoutError(
                f"{name} must be a positive integer, got {v!r}; pass --{name} 1 or more"
            )
    if ep > 1 and ep % tp:
        raise LayoutError(
            f"ep ({ep}) must be a multiple of tp ({tp}): EP spans tp*dp ranks; pass an --ep "
            "that is a multiple of --tp"
        )
    if ep == 1:
        shards = [ShardInfo(shard_id(t), t, 0) for t in range(tp)]
    else:
        shards = [ShardInfo(shard_id(e % tp, e), e % tp, e) for e in range(ep)]
    canonical = spec.canonical_shapes()

    def run() -> tuple[LayoutTable, list[ShardInfo]]:
        probes: dict[str, ShardProbe] = {}
        for s in shards:
            loader = make_loader(s.tp_rank, s.ep_rank)
            probes[s.id] = probe_shard(loader, canonical, config=config)
            del loader
        return assemble_table(canonical, probes), shards

    if cache is None:
        table, _ = run()
    else:
        base = model_config if model_config is not None else dataclasses.asdict(spec)
        table, cached = cache.get_or_probe(probe_key(base, engine, {"tp": tp, "ep": ep}), run)
        if [s.id for s in cached] != [s.id for s in shards]:
            raise LayoutError(
                f"cached layout for {engine} tp={tp} ep={ep} names other shards: remove it from "
                f"the cache {str(cache.root)!r}"
            )
        if table.src_shapes != canonical:
            raise LayoutError(
                f"cached layout for {engine} tp={tp} ep={ep} was probed for other tensors "
                f"than this model's: remove it from the cache {str(cache.root)!r}"
            )
    return ReceiverLayout(spec=spec, engine=engine, tp=tp, ep=ep, table=table, shards=shards)


PROBE_ENGINES = ("transformers", "vllm-reference")


def _hf_config(model_config: Mapping[str, Any]) -> Any:
    transformers = require_transformers()
    return transformers.AutoConfig.for_model(**dict(model_config))


def probe_engine_layout(
    model_config: Mapping[str, Any],
    engine: str,
    *,
    tp: int = 1,
    ep: int = 1,
    config: ProbeConfig | None = None,
    cache: ProbeCache | None = None,
) -> tuple[ReceiverLayout, dict[str, Any], float]:
    """Probe one of the engines this process can build, for a ``config.json`` dict.

    Args:
        model_config: the transformers config dict.
        engine: ``"vllm-reference"`` (:class:`VllmReferenceLoader` per TP/EP rank) or
            ``"transformers"`` (the transformers class's own loading; TP = EP = 1).
        tp, ep, config, cache: as :func:`probe_receiver_layout`.

    Returns:
        ``(layout, probe key, seconds)``.
    """
    from deltasync.layout.model_spec import ModelSpec

    spec = ModelSpec.from_hf_config(model_config)
    t0 = time.perf_counter()
    if engine == "vllm-reference":
        from deltasync.layout.reference_loader import VllmReferenceLoader

        def make(t: int, e: int) -> Any:
            return VllmReferenceLoader(spec, tp=tp, tp_rank=t, ep=ep, ep_rank=e)
    elif engine == "transformers":
        if tp != 1 or ep != 1:
            raise LayoutError(
                f"engine 'transformers' is one shard: tp and ep must be 1 (got {tp}, {ep}); "
                "probe sharded layouts with --engine vllm-reference"
            )
        from deltasync.layout.hf_model import TransformersLoader, empty_model

        hf_config = _hf_config(model_config)

        def make(t: int, e: int) -> Any:
            return TransformersLoader(empty_model(hf_config))
    else:
        raise LayoutError(f"unknown probe engine {engine!r}; known: {', '.join(PROBE_ENGINES)}")
    layout = probe_receiver_layout(
        spec,
        make,
        engine=engine,
        tp=tp,
        ep=ep,
        config=config,
        cache=cache,
        model_config=model_config,
    )
    return layout, probe_key(model_config, engine, {"tp": tp, "ep": ep}), time.perf_counter() - t0
