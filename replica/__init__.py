"""replica: checkpoint-free failover for FSDP trainers.

Every trainer rank's shard is mirrored after each optimizer step to a warm
standby; when a trainer dies, its standby is promoted and training resumes from
the last global commit. See README.md.

The names below are imported on first use (PEP 562): ``import replica.transport``
or ``import replica.errors`` loads no mirror, FSDP or vLLM code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from replica import errors
from replica.errors import *  # noqa: F403  (the typed errors are top-level API)

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from replica import ops
    from replica.config import Config
    from replica.distributed.resilient import ResilientProcessGroup, init_resilient_process_group
    from replica.mirror.replicator import Replicator
    from replica.mirror.standby import Mirror, fetch_mirror
    from replica.state.data import Batches
    from replica.state.export import load_export
    from replica.state.layout import StateLayout
    from replica.state.restore import restore_snapshot
    from replica.state.rng import RNGState
    from replica.state.snapshot import Snapshot
    from replica.weights import WeightReceiver, WeightSync

__version__ = "0.1.0"

#: public name -> the module that defines it (a module itself where both are the same)
_LAZY: dict[str, str] = {
    "Batches": "replica.state.data",
    "Config": "replica.config",
    "Mirror": "replica.mirror.standby",
    "RNGState": "replica.state.rng",
    "Replicator": "replica.mirror.replicator",
    "ResilientProcessGroup": "replica.distributed.resilient",
    "Snapshot": "replica.state.snapshot",
    "StateLayout": "replica.state.layout",
    "WeightReceiver": "replica.weights",
    "WeightSync": "replica.weights",
    "fetch_mirror": "replica.mirror.standby",
    "init_resilient_process_group": "replica.distributed.resilient",
    "load_export": "replica.state.export",
    "ops": "replica.ops",
    "restore_snapshot": "replica.state.restore",
}

# The lazy names, __version__ and the typed errors, in forms type checkers read (a call such as
# sorted() hides the names from them), then sorted in place.
__all__ = [
    "Batches",
    "Config",
    "Mirror",
    "RNGState",
    "Replicator",
    "ResilientProcessGroup",
    "Snapshot",
    "StateLayout",
    "WeightReceiver",
    "WeightSync",
    "fetch_mirror",
    "init_resilient_process_group",
    "load_export",
    "ops",
    "restore_snapshot",
    "__version__",
]
__all__ += errors.__all__
__all__[:] = sorted(__all__)


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'replica' has no attribute {name!r}")
    module = importlib.import_module(where)
    value = module if where == f"{__name__}.{name}" else getattr(module, name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
