"""In-cluster transport: a two-round exchange of byte payloads over one torch.distributed group.

    received = exchange({dst: payload, ...}, group=group, config=ExchangeConfig())

Round 1 gathers every rank's byte counts and status in one fixed-size collective; round 2 moves
the bytes by a plan every rank derives identically (``plan_schedule``). See ``rounds`` for the
contract, ``status_row`` for the fixed-size rows, ``schedule`` for why the plan cannot deadlock,
``notes`` for how gloo behaves on a timeout or a dead peer and how survivors name the culprit,
and ``launch`` for starting groups from torchrun or in tests.

This package moves opaque bytes; it knows nothing about blobs, versions or model layouts.
"""

from deltasync.exchange.launch import SpawnError, init_from_env, spawn
from deltasync.exchange.rounds import (
    ExchangeStats,
    Received,
    RoundTwoStats,
    exchange,
    group_device,
    run_schedule,
)
from deltasync.exchange.schedule import Batch, Chunk, ExchangeConfig, Schedule, plan_schedule

__all__ = [
    "Batch",
    "Chunk",
    "ExchangeConfig",
    "ExchangeStats",
    "Received",
    "RoundTwoStats",
    "Schedule",
    "SpawnError",
    "exchange",
    "group_device",
    "init_from_env",
    "plan_schedule",
    "run_schedule",
    "spawn",
]
