"""replica: checkpoint-free failover for FSDP trainers.

Every trainer rank's shard is mirrored after each optimizer step to a warm
standby; when a trainer dies, its standby is promoted and training resumes from
the last global commit. See README.md.
"""

from replica import errors, ops
from replica.config import Config
from replica.state.data import Batches
from replica.errors import *  # noqa: F403  (the typed errors are top-level API)
from replica.state.export import load_export
from replica.state.layout import StateLayout
from replica.mirror.standby import Mirror, fetch_mirror
from replica.mirror.replicator import Replicator
from replica.distributed.resilient import ResilientProcessGroup, init_resilient_process_group
from replica.state.restore import restore_snapshot
from replica.state.rng import RNGState
from replica.state.snapshot import Snapshot
from replica.weights import WeightReceiver, WeightSync

__version__ = "0.1.0"

__all__ = sorted([
    *errors.__all__,
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
    "__version__",
    "fetch_mirror",
    "init_resilient_process_group",
    "load_export",
    "ops",
    "restore_snapshot",
])
