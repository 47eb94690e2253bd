"""The joint commit: one bounded all_gather of every rank's ack row, then the same verdict on
every rank (``acks.judge``).

It is the last collective of a version. A rank commits (the trainer clears its tracker, a
receiver advances its version) only after this returns a positive verdict, so either every
rank commits the version or none does, except when a rank dies inside this very collective,
which no protocol over a dying group can exclude; the receivers' journal and the overwrite
semantics make a retry of the same version converge in that case too.

This module knows the collective and the wait; the row layout and verdict are in ``acks``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deltasync.cluster.acks import Verdict, decode_acks, judge
from deltasync.cluster.roles import RolePlan
from deltasync.exchange import group_device
from deltasync.exchange.waits import wait


def joint_commit(
    row: torch.Tensor,
    *,
    plan: RolePlan,
    group: dist.ProcessGroup | None,
    timeout_s: float,
) -> Verdict:
    """Gather ``row`` from every rank and judge. Raises ExchangeTimeoutError / ExchangeError
    (naming the joint commit) when a rank does not arrive in time or is dead."""
    world = dist.get_world_size(group)
    device = group_device(group)
    mine = row.to(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    wait(
        work,
        timeout_s=timeout_s,
        what=f"joint commit (all_gather of the ack rows of all {world} ranks)",
        peers="some rank of the group (a receiver still applying, or a dead rank)",
    )
    return judge(decode_acks(torch.stack(gathered)), plan)
