"""Benchmark programs, installed beside deltasync as ``deltasync_bench``.

Each program prints a table, ends with one JSON line, and checks that what it timed is exact;
they are programs, not timed tests. ``deltasync bench`` runs ``compare_bench`` (dense refit vs
snapshot delta vs deltasync, store path and in-cluster) and ``detect_bench``; the others run as
``python -m deltasync_bench.<name>`` (or ``python bench/<name>.py``):

    common.py            timing, memory bandwidth, RSS, the table and the JSON line
    compare/             the comparison's workload, systems, role processes and report
    compare_bench.py     ``deltasync bench [compare]``
    detect_bench.py      ``deltasync bench detect``: detection + codec vs the memory floor
    format_bench.py      the wire format's encode/decode/apply throughput
    route_bench.py       routing throughput, canonical -> every vLLM shard
    exchange_bench.py    the two-round exchange against plain gloo loopback
    dp_replicas_bench.py DP replicas: direct sends vs a receiver-side forward
    gpu_detect_bench.py  detection throughput on a CUDA device (the device tier)
    gpu_sync_bench.py    store-path sync from a CUDA trainer (the device tier)
    device_info.py       what the device tier runs on (versions, device, native kernels)
"""
