"""vLLM integration: weights pushed by ``replica.WeightSync`` land in a running
engine in place, without re-creating it and without touching disk.

``ReplicaWorkerExtension`` is a vLLM worker extension
(``LLM(..., worker_extension_cls="replica.vllm_worker.ReplicaWorkerExtension")``):
inside each worker it runs a ``WeightReceiver`` that receives and verifies
versions in the background, and loads a complete one on request through the
model runner's ``reload_weights`` (the CPU backend repacks its linear weights
after loading, so a plain ``model.load_weights`` after start-up fails there).
``EngineWeights`` drives it from the process that owns the ``LLM``: ``update()``
between generations applies the newest complete version and resets the prefix
cache (cached KV blocks were computed by the old weights).

A reload that fails half-way leaves a vLLM engine broken, so every version's
names and shapes are checked against the checkpoint the engine was started from
before anything is loaded. Only the names, shapes and step travel through
``collective_rpc``; the weights themselves arrive over ``replica.transport``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from replica.config import Config
from replica.errors import LayoutMismatchError
from replica.layout import StateLayout

__all__ = ["EngineWeights", "ReceiverSpec", "ReplicaWorkerExtension", "checkpoint_shapes"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, frozen=True, slots=True)
class ReceiverSpec:
    """What a worker needs to start its receiver (plain values: it crosses ``collective_rpc``).
    The token travels to the worker, never to a log."""

    index: int
    store_host: str
    store_port: int
    token_hex: str
    host: str = "127.0.0.1"
    store_prefix: str = "replica"
    timeout_s: float = 60.0

    def __repr__(self) -> str:
        return f"ReceiverSpec(index={self.index}, store={self.store_host}:{self.store_port})"


def checkpoint_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a safetensors checkpoint folder, from the file headers only."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    if not shapes:
        raise FileNotFoundError(f"no safetensors checkpoint in {folder}")
    return shapes


def check_fits(layout: StateLayout, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every pushed tensor must be a checkpoint tensor of the same shape (a subset is fine)."""
    for e in layout.entries:
        if e.name not in shapes:
            raise LayoutMismatchError(f"the engine's checkpoint has no tensor named {e.name!r}")
        if tuple(e.shape) != shapes[e.name]:
            raise LayoutMismatchError(f"{e.name}: {tuple(e.shape)} pushed, the engine's checkpoint has "
                                      f"{shapes[e.name]}")


class ReplicaWorkerExtension:
    """Mixed into vLLM's worker class; its methods are called through
    ``LLM.collective_rpc``. Uses the worker's ``model_runner`` and ``vllm_config``."""

    def replica_attach(self, spec_json: str) -> str:
        """Start this worker's receiver; returns its registration (backend, address, nonce)."""
        import torch.distributed as dist

        from replica.weights import WeightReceiver

        spec = ReceiverSpec(**json.loads(spec_json))
        shapes = checkpoint_shapes(self.vllm_config.model_config.model)
        store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False,
                              timeout=timedelta(seconds=spec.timeout_s))
        config = Config(token=bytes.fromhex(spec.token_hex), host=spec.host, store_prefix=spec.store_prefix,
                        timeout=timedelta(seconds=spec.timeout_s))
        self._replica_receiver = WeightReceiver(index=spec.index, store=store, config=config,
                                                expect=lambda layout: check_fits(layout, shapes))
        logger.info("[engine %d] weight receiver at %s", spec.index, self._replica_receiver.address)
        return self._replica_receiver.registration

    def replica_ready(self) -> int | None:
        return self._replica_receiver.ready()

    def replica_wait(self, step: int, timeout_s: float) -> bool:
        return self._replica_receiver.wait_ready(step, timedelta(seconds=timeout_s))

    def replica_apply(self) -> int | None:
        """Load the newest complete version in place; returns its step (None: nothing new)."""
        from vllm.config import set_current_vllm_config

        def load(views) -> None:
            with set_current_vllm_config(self.vllm_config):
                self.model_runner.reload_weights(weights_iterator=views, is_checkpoint_format=True)

        return self._replica_receiver.apply(load)

    def replica_version(self) -> int | None:
        return self._replica_receiver.version

    def replica_detach(self) -> None:
        receiver = getattr(self, "_replica_receiver", None)
        if receiver is not None:
            receiver.close()
            self._replica_receiver = None


class EngineWeights:
    """The driver's handle on an engine's weights: ``attach`` once, ``update()``
    between generations, ``wait(step)`` when a request needs a version."""

    EXTENSION = f"{__name__}.ReplicaWorkerExtension"

    def __init__(self, llm, spec: ReceiverSpec):
        self.llm = llm
        self.spec = spec
        self.registrations = llm.collective_rpc("replica_attach", args=(json.dumps(asdict(spec)),))
        if len(self.registrations) != 1:
            self.close()
            raise NotImplementedError(f"an engine with {len(self.registrations)} workers (tensor parallel): each "
                                      "worker would need its own receiver registration; only one is supported yet")

    @property
    def version(self) -> int | None:
        return self._one(self.llm.collective_rpc("replica_version"))

    def update(self) -> int | None:
        """Apply the newest complete version, if any; returns it (None: unchanged)."""
        applied = self._one(self.llm.collective_rpc("replica_apply"))
        if applied is not None:
            self.llm.reset_prefix_cache()  # KV blocks cached under the old weights are stale
        return applied

    def wait(self, step: int, timeout: timedelta) -> int:
        """Serve at least version ``step``: wait for it to arrive, then apply it."""
        if not all(self.llm.collective_rpc("replica_wait", args=(step, timeout.total_seconds()))):
            raise TimeoutError(f"engine {self.spec.index}: weights of step {step} did not arrive within {timeout}")
        self.update()
        return self.version

    def close(self) -> None:
        self.llm.collective_rpc("replica_detach")

    @staticmethod
    def _one(results: list):
        """Every worker holds the same version (tensor-parallel workers apply together)."""
        if len(set(results)) != 1:
            raise RuntimeError(f"the engine's workers disagree: {results}")
        return results[0]
