"""The main job (``deltasync demo``): a real RL-style trainer syncing to rollout processes."""
