"""The module paths of replica 0.1's flat layout, kept working: ``import
replica.vllm_transfer`` (or ``replica.jobstate``, ``replica.commit`` ...) loads the module's
new home and binds it under the old name too, the same module object, so code written
against 0.1 (and a vLLM configured with the old plugin path) runs unchanged. New code
uses the new paths; nothing inside replica imports an old one."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType

__all__ = ["MOVED", "install"]

#: old module path -> where it lives now
MOVED: dict[str, str] = {
    "replica.backends": "replica.session.backends",
    "replica.bucketstream": "replica.session.bucketstream",
    "replica.commit": "replica.jobstore.commit",
    "replica.data": "replica.state.data",
    "replica.divergence": "replica.state.divergence",
    "replica.etcd": "replica.jobstore.etcd",
    "replica.etcdwatch": "replica.jobstore.etcdwatch",
    "replica.export": "replica.state.export",
    "replica.jobstate": "replica.jobstore",
    "replica.layout": "replica.state.layout",
    "replica.listener": "replica.session.listener",
    "replica.pagebuffer": "replica.weights.pagebuffer",
    "replica.placement": "replica.state.placement",
    "replica.protocol": "replica.session.protocol",
    "replica.registry": "replica.jobstore.registry",
    "replica.repair": "replica.mirror.repair",
    "replica.replicator": "replica.mirror.replicator",
    "replica.resilient": "replica.distributed.resilient",
    "replica.restore": "replica.state.restore",
    "replica.rng": "replica.state.rng",
    "replica.serialize": "replica.state.serialize",
    "replica.snapshot": "replica.state.snapshot",
    "replica.stores": "replica.jobstore.stores",
    "replica.stream": "replica.mirror.stream",
    "replica.vllm_plugin": "replica.integrations.vllm.plugin",
    "replica.vllm_staging": "replica.integrations.vllm.staging",
    "replica.vllm_transfer": "replica.integrations.vllm.transfer",
    "replica.vllm_worker": "replica.integrations.vllm.worker",
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:  # noqa: ARG002 - the finder protocol
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name])
        module.__dict__.setdefault("_replica_spec", module.__spec__)
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module ran at its new home; the import machinery stamped the old name's spec
        on it, which would tell ``importlib.reload`` and tools a wrong origin: put back its own."""
        module.__spec__ = module.__dict__.pop("_replica_spec")


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``import replica`` calls this)."""
    if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
        sys.meta_path.append(_Alias())
