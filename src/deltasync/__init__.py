"""deltasync: sparse, bit-exact BF16 policy-weight sync from an RL trainer to rollout workers.

The public API is small and comes in inverse pairs; see the README for the data flow.
"""

from deltasync.trainer import AdamWTracker, SnapshotTracker

__version__ = "0.1.0"

__all__ = ["AdamWTracker", "SnapshotTracker", "__version__"]
