"""In-cluster sync: trainer ranks send each version's changed BF16 elements straight to the
rollout ranks over one torch.distributed group, and every rank commits the version jointly.

    plan = RolePlan.contiguous(num_writers=1, shards=["tp0", "tp1"], replicas=2)
    # a trainer rank                                 # a rollout rank
    sender = ClusterSender(tracker, params,          receiver = ClusterReceiver(tensors,
        plan=plan, trainer_layout=tl,                    plan=plan, layout=rl, version=0)
        receiver_layout=rl, version=0)               receiver.sync()   # per version
    sender.sync()   # per version, after optimizer.step()
    # or ClusterSender(..., overlap=True, optimizer=opt): sync() returns once the changes are
    # captured; the rest runs while the next forward/backward does (opt's next step waits)

Data flow of one version, by module::

    roles.py     who writes which trainer shard, who holds which receiver shard, who sends to
                 whom (DP replicas: "direct" sends or a receiver-side "forward")      (pure)
    cluster_sender.py  tracker.iter_changes() (united with uncommitted attempts) ->
                 layout.routing -> format (blobs) -> envelope.py (+ layout.part_digests)
    preflight.py every rank's fingerprint, versions and status in one all_gather: refused
                 everywhere before any payload moves, or cleared
    cluster_receiver.py  exchange -> staging.py (verify the blobs, base check; the writers'
                 records read in lockstep, one tensor at a time, hashed as the shard will be)
                 -> cluster_journal.py -> apply (the pause: the records again, per tensor)
    joint_commit.py  every rank's status row, one all_gather, the same verdict: commit
                 everywhere, or nowhere

The wire format, the routing and the receiver-side streaming read are the storage path's own;
what this package adds is the process-group choreography. It knows nothing about stores.
"""

from deltasync.cluster.background import PendingSend
from deltasync.cluster.cluster_receiver import ClusterReceiver
from deltasync.cluster.cluster_sender import ClusterSender
from deltasync.cluster.reports import ApplyReport, ReceiveReport, SendReport
from deltasync.cluster.roles import (
    DEFAULT_DP_MODE,
    DP_MODES,
    ClusterConfig,
    ReceiverRole,
    RolePlan,
    WriterRole,
)
from deltasync.errors import (
    AnchorRequiredError,
    EnvelopeError,
    FingerprintMismatchError,
    SendFailedError,
    SyncAbortedError,
)

__all__ = [
    "DEFAULT_DP_MODE",
    "DP_MODES",
    "AnchorRequiredError",
    "ApplyReport",
    "ClusterConfig",
    "ClusterReceiver",
    "ClusterSender",
    "EnvelopeError",
    "FingerprintMismatchError",
    "PendingSend",
    "ReceiveReport",
    "ReceiverRole",
    "RolePlan",
    "SendFailedError",
    "SendReport",
    "SyncAbortedError",
    "WriterRole",
]
