"""replica as a backend of vLLM's own weight-transfer API (``vllm.distributed.weight_transfer``).

A user starts the engine with ``weight_transfer_config={"backend": "replica"}`` (the
``replica`` plugin registers the backend in every vLLM process: ``vllm.general_plugins``)
and calls vLLM's methods: ``init_weight_transfer_engine`` -> ``start_weight_update`` ->
``update_weights`` -> ``finish_weight_update``, on an ``LLM``, an ``AsyncLLM`` or the
server. The trainers call ``ReplicaTrainerEngine.send_weights(step)`` (through vLLM's
``WeightTransferTrainerFactory.trainer_init`` or directly), which pushes the weights with a
``WeightSync`` and drives those calls through the client it was given.

Everything ``WeightSync`` guarantees holds: the weights travel over replica's transports in
digest-checked buckets while the engine keeps generating, outside vLLM's RPCs; only the
version number crosses them. ``update_weights`` then applies exactly that version (prepared
beside the live model, or reloaded in place with vLLM's ``reload_weights``), so the workers
of a tensor-parallel engine serve one version; a sync cut short is never applied; a
superseded trainer's (old epoch) is refused by the receivers; an engine the push skipped
keeps its version (``if_ready``) and is refreshed by a later push.

Worker ``i`` of an engine registers as receiver ``index_base + dp_index * world_size + rank``
(tensor-parallel workers each receive the full tensors and load their part, as vLLM's own
backends do). The job token comes from ``REPLICA_TOKEN`` in the engine's environment, or
from the init info (``token_hex``; never in a repr or a log).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from replica.config import Config, token_from_env
from replica.errors import VersionNotReadyError, WeightTransferNotStartedError
from replica.integrations.vllm.plugin import BACKEND, register
from replica.integrations.vllm.worker import ReceiverSpec, WorkerWeights
from replica.jobstore import Epoch
from replica.jobstore.stores import StoreAddress
from replica.weights import SyncStats, WeightSource, WeightSync

__all__ = [
    "BACKEND",
    "EnginesClient",
    "LLMClient",
    "ReplicaInitInfo",
    "ReplicaTrainerEngine",
    "ReplicaTrainerInitInfo",
    "ReplicaUpdateInfo",
    "ReplicaWeightTransferEngine",
    "ServerClient",
]

logger = logging.getLogger(__name__)


# --- the engine's side (in each vLLM worker) ---


@dataclass(kw_only=True)
class ReplicaInitInfo(WeightTransferInitInfo):
    """``init_weight_transfer_engine``'s ``init_info`` (plain values: it crosses vLLM's RPCs)."""

    store: str  # the job store: HOST:PORT or etcd://HOSTS/NAMESPACE (credentials in REPLICA_ETCD_*)
    index_base: int = 0  # the receiver index of this engine's first worker
    host: str = "127.0.0.1"  # where the receivers listen
    store_prefix: str = "replica"
    timeout_s: float = 60.0
    # True: each version is prepared beside the live model while the engine generates
    # (ReceiverSpec.staged); with buffers=1 the engine holds the live weights and one more copy. An
    # update then switches in milliseconds, but one asking for a version just pushed waits for its
    # preparation (longer than an in-place reload): in place by default.
    staged: bool | None = False
    leader: int = 0  # the trainer rank whose epoch the receivers accept
    # Receive buffers: 1 (the model's size: each version is applied by the update that follows its
    # push) or 2 (versions may arrive while one waits to be applied).
    buffers: int = 1
    backends: list[str] | None = None  # the receivers' transports (Config.backends); None: the default
    token_hex: str | None = field(default=None, repr=False)  # None: REPLICA_TOKEN of the engine's environment

    def __post_init__(self):
        StoreAddress.parse(self.store)  # ValueError naming what is wrong
        if self.index_base < 0 or self.timeout_s <= 0 or self.leader < 0 or self.buffers not in (1, 2):
            raise ValueError(
                f"need index_base >= 0, timeout_s > 0, leader >= 0 and buffers 1 or 2; got "
                f"{self.index_base}, {self.timeout_s}, {self.leader}, {self.buffers}"
            )
        if self.backends is not None and (
            not isinstance(self.backends, (list, tuple))
            or not self.backends
            or not all(isinstance(b, str) for b in self.backends)
        ):
            raise ValueError(f"backends must be a non-empty list of transport names, got {self.backends!r}")
        if self.token_hex is not None:
            try:
                if not bytes.fromhex(self.token_hex):
                    raise ValueError
            except ValueError:
                raise ValueError("token_hex: the job token as hex, not empty") from None


@dataclass(kw_only=True)
class ReplicaUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights``' ``update_info``: serve exactly ``version`` (None: the newest
    complete version, if it is newer than the served one: what an engine that applies
    versions as they come asks, ``replica.integrations.vllm.worker.EngineWeights``)."""

    version: int | None = None
    wait_s: float = 60.0  # how long a version that arrived may take to be prepared (staged)
    if_ready: bool = False  # True: a worker without the version keeps its own (the push skipped it)

    def __post_init__(self):
        if (self.version is not None and self.version < 0) or self.wait_s < 0:
            raise ValueError(f"need version >= 0 (or None) and wait_s >= 0; got {self.version}, {self.wait_s}")


class ReplicaWeightTransferEngine(WeightTransferEngine[ReplicaInitInfo, ReplicaUpdateInfo]):
    """The worker side: a ``WeightReceiver`` (``WorkerWeights``) started by
    ``init_transfer_engine``; ``update_weights`` applies a version it holds, in one call
    (the model is never left half-loaded between vLLM's RPCs, when the engine may step)."""

    init_info_cls = ReplicaInitInfo
    update_info_cls = ReplicaUpdateInfo
    supports_draft_weight_update = False  # versions are checked against the target model's checkpoint

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        self._weights: WorkerWeights | None = None
        self.index: int | None = None

    @property
    def weights(self) -> WorkerWeights:
        if self._weights is None:
            raise WeightTransferNotStartedError(
                "the replica weight-transfer engine is not initialized: call init_weight_transfer_engine first"
            )
        return self._weights

    def init_transfer_engine(self, init_info: ReplicaInitInfo) -> None:
        self.shutdown()  # a second init starts afresh (after shutdown_weight_transfer_engine, or a new job store)
        parallel = self.vllm_config.parallel_config
        self.index = init_info.index_base + parallel.data_parallel_index * parallel.world_size + parallel.rank
        token = bytes.fromhex(init_info.token_hex) if init_info.token_hex else token_from_env()
        spec = ReceiverSpec(
            index=self.index,
            store=init_info.store,
            token_hex="",
            host=init_info.host,
            store_prefix=init_info.store_prefix,
            timeout_s=init_info.timeout_s,
            staged=init_info.staged,
            leader=init_info.leader,
            buffers=init_info.buffers,
            backends=None if init_info.backends is None else tuple(init_info.backends),
        )
        self._weights = WorkerWeights(
            spec, token=token, vllm_config=self.vllm_config, model=self.model, reload=self._reload
        )

    def _reload(self, views: Iterator[tuple[str, torch.Tensor]]) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        with set_current_vllm_config(self.vllm_config):
            reload_weights(self.vllm_config, self.model, views, None, True)

    def start_weight_update(self) -> None:
        self.weights  # noqa: B018 - initialized, or a clear error before any update

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's base synchronizes torch.accelerator, which raises on a CPU-only torch.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: ReplicaUpdateInfo) -> None:
        weights = self.weights
        version = update_info.version
        if version is None:
            weights.apply()
            return
        if weights.receiver.version == version:
            return
        received = weights.newest()
        if received is not None and received >= version and update_info.wait_s > 0:
            # Arrived (the push returns once every engine has it whole): staged, let it be prepared.
            weights.wait(version, timedelta(seconds=update_info.wait_s))
        try:
            weights.apply(exactly=version)
        except VersionNotReadyError:
            if not update_info.if_ready:
                raise
            logger.warning(
                "[engine %d] version %d did not arrive: serving version %s",
                self.index,
                version,
                weights.receiver.version,
            )

    def finish_weight_update(self) -> None:
        pass  # the version was applied whole by update_weights; vLLM's worker resets LoRA state after this

    @property
    def version(self) -> int | None:
        return None if self._weights is None else self._weights.receiver.version

    def shutdown(self) -> None:
        if self._weights is not None:
            self._weights.close()
            self._weights = None


# --- the trainers' side ---


@dataclass(kw_only=True)
class ReplicaTrainerInitInfo(TrainerInitInfo):
    """What every trainer rank passes to ``trainer_init`` (with its ``rank``; rank 0 sends)."""

    backend: ClassVar[str] = BACKEND

    store: str  # the job store the engines' receivers register in
    engines: int  # receivers in all: engines x their workers (tensor parallel)
    index_base: int = 0  # the first receiver index of the engine the client drives
    host: str = "127.0.0.1"  # where the engines' receivers listen
    store_prefix: str = "replica"
    timeout_s: float = 60.0
    staged: bool | None = False  # ReplicaInitInfo.staged
    buffers: int = 1  # the engines' receive buffers (ReplicaInitInfo.buffers)
    config: Config | None = None  # the sender's transfer settings (default: the job token from REPLICA_TOKEN)
    epoch: Callable[[], Epoch] | None = None  # the trainer's epoch (replica.Job): receivers refuse a superseded one
    send_token: bool = False  # False: the engines read REPLICA_TOKEN themselves; True: it goes in the init info
    wait_s: float = 60.0

    def __post_init__(self):
        StoreAddress.parse(self.store)
        if self.engines < 1 or self.index_base < 0:
            raise ValueError(f"need engines >= 1 and index_base >= 0; got {self.engines}, {self.index_base}")


class ReplicaTrainerEngine(TrainerWeightTransferEngine[ReplicaTrainerInitInfo]):
    """The trainers' side: ``send_weights(step)`` on every rank pushes the weights of ``step``
    (a ``WeightSync``: gathers on every rank, the sender packs and sends), then the sender
    has the engines apply it through the client (start, update, finish)."""

    init_info_cls = ReplicaTrainerInitInfo
    # What trainer_init was given: replica's kind of source, not the vLLM WeightSource the base class
    # types its (only stored) source as, so it is set here, not passed to the base.
    source: WeightSource | torch.nn.Module | None

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | torch.nn.Module | None,
        sync: WeightSync,
        info: ReplicaTrainerInitInfo,
    ):
        super().__init__(client=client, is_sender=info.is_sender)
        self.source = source
        self.sync = sync
        self.info = info
        self._step = 0

    @classmethod
    def trainer_init(
        cls,
        init_info: ReplicaTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | torch.nn.Module | None = None,
    ) -> ReplicaTrainerEngine:
        if source is None:
            raise ValueError("the replica backend needs a source: the model (or a WeightSource) to push")
        config = init_info.config or Config(
            token=token_from_env(), timeout=timedelta(seconds=init_info.timeout_s), store_prefix=init_info.store_prefix
        )
        store = StoreAddress.parse(init_info.store).connect(timeout=timedelta(seconds=init_info.timeout_s))
        sync = WeightSync(
            source,
            store=store,
            num_engines=init_info.engines,
            config=config,
            rank=init_info.rank,
            leader=0,
            epoch=init_info.epoch,
        )
        if init_info.is_sender:
            spec = ReceiverSpec(
                index=init_info.index_base,
                store=init_info.store,
                token_hex=config.token.hex() if init_info.send_token else "",
                host=init_info.host,
                store_prefix=config.store_prefix,
                timeout_s=init_info.timeout_s,
                staged=init_info.staged,
                buffers=init_info.buffers,
                backends=config.backends,
            )
            client.init_weight_transfer_engine(spec.init_info())
        return cls(client=client, source=source, sync=sync, info=init_info)

    def send_weights(self, step: int | None = None) -> SyncStats:
        """Push the weights (of ``step``; default: one more than the last) and, on the sender,
        have the engines serve them. Every rank calls it (the gathers are collectives).
        Engines the push skipped keep their version; the stats name them."""
        self._step = self._step + 1 if step is None else step
        stats = self.sync.push(self._step)
        if self.is_sender:
            self.client.start_weight_update()
            try:
                self.client.update_weights(
                    {"version": self._step, "wait_s": self.info.wait_s, "if_ready": bool(stats.engines_skipped)}
                )
            except BaseException:
                try:  # ends the update on the workers that did not fail (the failed one ended its own)
                    self.client.finish_weight_update(None)
                except Exception:
                    logger.debug("finish_weight_update after a failed update", exc_info=True)
                raise
            # vLLM's label of the engine's weights: set only when every engine took the version (a
            # skipped one serves its own; keys.engine_version(i) in the job store says which).
            self.client.finish_weight_update(None if stats.engines_skipped else str(self._step))
        return stats

    def shutdown(self) -> None:
        self.sync.close()


class LLMClient:
    """vLLM's ``VLLMWeightSyncClient`` for an engine in this process (``vllm.LLM``), which
    vLLM does not ship; after each version the engine's prefix cache is reset (KV blocks
    cached under the old weights are stale)."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
        self.llm.reset_prefix_cache()


def _unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says an engine cannot be reached (its process is gone), not that it
    refused a call (an HTTP error status, a VersionNotReadyError: those are raised)."""
    if isinstance(exc, ConnectionError):
        return True
    try:
        import requests
    except ImportError:
        return False
    return isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.Timeout))


class EnginesClient:
    """vLLM's ``VLLMWeightSyncClient`` over several engines, each through a client of its own
    (``LLMClient``, ``ServerClient``, ...): every call goes to every engine. Engine ``k``'s
    workers are receivers ``index_base + k * workers`` on (``init_weight_transfer_engine``'s
    ``index_base`` is set per engine; ``ReplicaTrainerInitInfo.engines`` counts them all).

    An engine that cannot be reached (its process died: a connection error, not a refusal)
    is left out, with a warning, until ``replace(k, client)`` puts a new one in its place: the
    push that finds it gone skips it and the others apply the version (``if_ready``); the
    replacement is initialized at once and the next push refreshes it."""

    def __init__(self, clients, *, workers: int = 1):
        if not clients or workers < 1:
            raise ValueError(f"need at least one client and workers >= 1; got {len(clients)}, {workers}")
        self._clients = list(clients)
        self._workers = workers
        self._init: dict[str, Any] | None = None
        self.down: set[int] = set()  # engines left out (unreachable) until replaced

    def _info(self, init: dict[str, Any], k: int) -> dict[str, Any]:
        """``init`` (the init info given last) for engine ``k``."""
        return {**init, "index_base": init.get("index_base", 0) + k * self._workers}

    def _each(self, call: Callable[[Any], None], what: str) -> None:
        for k, client in enumerate(self._clients):
            if k in self.down:
                continue
            try:
                call(client)
            except Exception as exc:
                if not _unreachable(exc):
                    raise
                self.down.add(k)
                logger.warning(
                    "engine %d cannot be reached (%s: %s): left out of %s and every later call until it is replaced",
                    k,
                    type(exc).__name__,
                    exc,
                    what,
                )

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        init = self._init = dict(init_info)
        for k, client in enumerate(self._clients):
            if k not in self.down:
                client.init_weight_transfer_engine(self._info(init, k))  # a new job: every engine must take it

    def replace(self, k: int, client) -> None:
        """Engine ``k`` is ``client``'s from now on (a replacement for one that died)."""
        if not 0 <= k < len(self._clients):
            raise ValueError(f"no engine {k}: there are {len(self._clients)}")
        if self._init is not None:
            client.init_weight_transfer_engine(self._info(self._init, k))
        self._clients[k] = client
        self.down.discard(k)

    def start_weight_update(self) -> None:
        self._each(lambda c: c.start_weight_update(), "start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._each(lambda c: c.update_weights(update_info), "update_weights")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each(lambda c: c.finish_weight_update(weight_version), "finish_weight_update")


class ServerClient(HTTPVLLMWeightSyncClient):
    """vLLM's HTTP client for the OpenAI-compatible server's weight-transfer routes (mounted
    with ``VLLM_SERVER_DEV_MODE=1``), which also resets the server's prefix cache after each
    version (``/reset_prefix_cache``)."""

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        super().finish_weight_update(weight_version)
        self._post("reset_prefix_cache")


# A trainer is no vLLM process (vLLM loads its plugins in its own): importing this module makes
# the backend known to WeightTransferTrainerFactory here too.
register()
