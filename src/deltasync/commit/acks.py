"""Joint commit and bounded staleness: waiting on what receivers report in the store.

- :func:`wait_for_acks` (synchronous RL): returns once every named receiver holds ``version``
  or later, verified: an ack of exactly ``version`` whose state digest is the manifest's digest
  of the receiver's shard, or a registration record at a later version (a receiver that
  jumped over ``version`` through a chain acknowledges only where it landed);
- :func:`wait_for_staleness` (asynchronous RL): returns once no live registered receiver is
  more than ``max_staleness`` versions behind ``committed`` (counted by version number).

Every wait names what it waits for. This module knows records and manifests, not tensors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from deltasync.commit.catalog import Catalog
from deltasync.commit.records import AckRecord
from deltasync.errors import AckTimeoutError, IntegrityError, StalenessTimeoutError

log = logging.getLogger(__name__)


def _lagging(
    catalog: Catalog, committed: int, max_staleness: int, ttl_s: float
) -> dict[str, int | None]:
    out = {}
    for rid, rec in catalog.live_receivers(ttl_s).items():
        held = -1 if rec.version is None else rec.version  # nothing yet: behind everything
        if committed - held > max_staleness:
            out[rid] = rec.version
    return out


def wait_for_staleness(
    catalog: Catalog,
    committed: int | None,
    *,
    max_staleness: int,
    ttl_s: float,
    timeout_s: float,
    poll_s: float,
) -> float:
    """Block until every live receiver holds >= ``committed - max_staleness``; return seconds
    waited. StalenessTimeoutError names the receivers that stayed behind."""
    if committed is None:
        return 0.0
    t0 = time.monotonic()
    logged = False
    while True:
        lagging = _lagging(catalog, committed, max_staleness, ttl_s)
        if not lagging:
            if logged:
                log.info(
                    "bounded staleness: receivers caught up after %.1f s", time.monotonic() - t0
                )
            return time.monotonic() - t0
        if not logged:
            log.info(
                "bounded staleness %d: waiting (up to %.0f s) for receivers %s (receiver: version "
                "held) to come within %d versions of committed version %d",
                max_staleness,
                timeout_s,
                lagging,
                max_staleness,
                committed,
            )
            logged = True
        if time.monotonic() - t0 >= timeout_s:
            raise StalenessTimeoutError(
                f"bounded staleness {max_staleness}: after {timeout_s:.1f} s receivers "
                f"{lagging} (receiver: version held) are still more than {max_staleness} "
                f"versions behind committed version {committed}; nothing was published. Check "
                "those receivers, or let their heartbeat expire (receiver_ttl_s) to drop them"
            )
        time.sleep(poll_s)


def wait_for_acks(
    catalog: Catalog,
    version: int,
    receivers: Iterable[str],
    *,
    timeout_s: float,
    poll_s: float,
) -> dict[str, AckRecord | None]:
    """``{receiver: ack}`` once each named receiver holds ``version`` or later (ack None when a
    receiver's record shows a later version instead). AckTimeoutError names the missing."""
    wanted = list(dict.fromkeys(receivers))
    manifest = catalog.manifest(version)
    done: dict[str, AckRecord | None] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        acks = catalog.acks(version)
        records = None
        for rid in wanted:
            if rid in done:
                continue
            ack = acks.get(rid)
            if ack is not None:
                expected = manifest.shard_digests.get(ack.shard)
                if expected != ack.state_digest:
                    raise IntegrityError(
                        f"receiver {rid!r} acknowledged version {version} for shard {ack.shard!r} "
                        f"with state digest {ack.state_digest}, but the manifest says {expected}: "
                        "that receiver runs a different layout or is broken"
                    )
                done[rid] = ack
                continue
            if records is None:
                records = catalog.receivers()
            rec = records.get(rid)
            if rec is not None and rec.version is not None and rec.version > version:
                done[rid] = None
        missing = [r for r in wanted if r not in done]
        if not missing:
            return done
        if time.monotonic() >= deadline:
            raise AckTimeoutError(
                f"version {version}: waited {timeout_s:.1f} s for acknowledgements from "
                f"receivers {missing} (acknowledged: {sorted(done)}); they are down, slow, or "
                "failing to apply (see their logs). The version stays committed"
            )
        time.sleep(poll_s)
