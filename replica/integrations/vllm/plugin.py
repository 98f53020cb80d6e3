"""The ``replica`` vLLM plugin (entry point group ``vllm.general_plugins``): vLLM calls
``register()`` in each of its processes (the LLM's, the engine core's, every worker's), so
that ``weight_transfer_config={"backend": "replica"}`` finds replica's weight-transfer
engine (``replica.integrations.vllm.transfer``) and ``WeightTransferTrainerFactory`` its trainer side.
Nothing is imported until an engine is created; a second call changes nothing."""

from __future__ import annotations

import contextlib
import logging

__all__ = ["BACKEND", "register"]

logger = logging.getLogger(__name__)

BACKEND = "replica"


def register() -> None:
    """Register the ``replica`` backend in vLLM's weight-transfer factories (idempotent;
    never raises: a plugin that raises would stop vLLM from starting)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory
    except ImportError as exc:  # a vLLM without the weight-transfer API
        logger.warning("vLLM has no weight-transfer API here (%s): the replica backend is not registered", exc)
        return
    for factory, name in (
        (WeightTransferEngineFactory, "ReplicaWeightTransferEngine"),
        (WeightTransferTrainerFactory, "ReplicaTrainerEngine"),
    ):
        with contextlib.suppress(ValueError):  # registered already in this process
            factory.register_engine(BACKEND, "replica.integrations.vllm.transfer", name)
