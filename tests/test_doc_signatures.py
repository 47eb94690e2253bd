"""The API listings in docs/ name every argument the code takes.

Each listing writes a constructor or method as ``Name(arg, *, kw=default, ...)``; a parameter
added to the code and not to its listing leaves users reading an incomplete API. The check
reads the listing's argument names (balanced parentheses from ``Name(``) and compares them
with ``inspect.signature``: every real parameter must be listed, and nothing listed may be
missing from the code. ``PublisherConfig``'s fields are read from its table.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from deltasync import (
    Publisher,
    PublisherConfig,
    Receiver,
    ReceiverConfig,
    TrainerSync,
)
from deltasync.cluster import ClusterConfig, ClusterReceiver, ClusterSender, RolePlan

DOCS = Path(__file__).resolve().parents[1] / "docs"

# (doc, the text that opens the listing, the callable it lists)
LISTINGS = [
    ("sync.md", "Publisher(store,", Publisher),
    ("sync.md", "TrainerSync(tracker,", TrainerSync),
    ("sync.md", "Receiver(store,", Receiver),
    ("sync.md", "ReceiverConfig(*,", ReceiverConfig),
    ("cluster.md", "`ClusterConfig(*,", ClusterConfig),
    ("cluster.md", "`ClusterSender(tracker,", ClusterSender),
    ("cluster.md", "`ClusterReceiver(tensors,", ClusterReceiver),
    ("cluster.md", "`RolePlan(*,", RolePlan),
    ("cluster.md", "`RolePlan.contiguous(*,", RolePlan.contiguous),
]


def listed_arguments(text: str, opening: str) -> set[str]:
    """The argument names of the listing that starts at ``opening`` in ``text``."""
    start = text.index(opening) + opening.index("(") + 1
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        end += 1
    body = text[start : end - 1]
    # drop nested calls (defaults such as ExchangeConfig()) and comments, then split
    body = re.sub(r"#[^\n]*", "", body)
    while re.search(r"\([^()]*\)", body):
        body = re.sub(r"\([^()]*\)", "", body)
    names = set()
    for part in body.split(","):
        part = part.strip()
        if part and part != "*":
            names.add(re.split(r"[=:\s]", part, maxsplit=1)[0])
    return names


def real_arguments(obj) -> set[str]:
    params = inspect.signature(obj).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


@pytest.mark.parametrize("doc,opening,obj", LISTINGS, ids=[o for _, o, _ in LISTINGS])
def test_listing_names_every_argument(doc: str, opening: str, obj) -> None:
    listed = listed_arguments((DOCS / doc).read_text(), opening)
    real = real_arguments(obj) - {"self", "cls"}
    assert real - listed == set(), f"docs/{doc} {opening!r} does not list {sorted(real - listed)}"
    assert listed - real == set(), f"docs/{doc} {opening!r} lists unknown {sorted(listed - real)}"


def test_publisher_config_table_names_every_field() -> None:
    text = (DOCS / "sync.md").read_text()
    table = text[text.index("`PublisherConfig` (keyword-only") :].split("\n\n")[1]
    listed = {
        name for row in table.splitlines() for name in re.findall(r"`(\w+)`", row.split("|")[1])
    }
    real = real_arguments(PublisherConfig)
    assert real - listed == set(), (
        f"docs/sync.md's PublisherConfig table lacks {sorted(real - listed)}"
    )
    assert listed - real == set(), (
        f"docs/sync.md's PublisherConfig table lists {sorted(listed - real)}"
    )


def test_listing_parser_reads_nested_defaults() -> None:
    text = "x = Thing(a, *, b=Other(c=1, d=(2, 3)), e=None)  # note (f, g)\n"
    assert listed_arguments(text, "Thing(a,") == {"a", "b", "e"}
