"""The ``vllm.general_plugins`` entry point: registers weight-transfer backend ``"deltasync"``.

vLLM calls :func:`register` in every process it starts (front end, engine core, workers),
possibly more than once per process. Registration is by module path, so nothing of
deltasync's vLLM backend is imported until vLLM creates an engine with
``weight_transfer_config={"backend": "deltasync"}``. No vLLM code is patched.

This module knows the backend's name and where its classes live; nothing else.
"""

from __future__ import annotations

BACKEND = "deltasync"
WORKER_ENGINE = ("deltasync.engines.vllm_backend", "DeltaSyncWeightTransferEngine")
TRAINER_ENGINE = ("deltasync.engines.vllm_trainer", "DeltaSyncTrainerEngine")


def register() -> None:
    """Register the worker and trainer engines with vLLM's factories (idempotent)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, (module, cls) in (
        (WeightTransferEngineFactory, WORKER_ENGINE),
        (WeightTransferTrainerFactory, TRAINER_ENGINE),
    ):
        try:
            factory.register_engine(BACKEND, module, cls)
        except ValueError:  # registered already: vLLM loads plugins more than once
            pass
