"""replica: checkpoint-free failover for FSDP trainers.

Every trainer rank's shard is mirrored after each optimizer step to a warm
standby; when a trainer dies, its standby is promoted and training resumes from
the last global commit. See README.md.
"""

from replica import errors, ops
from replica.config import Config
from replica.data import Batches
from replica.errors import *  # noqa: F403  (the typed errors are top-level API)
from replica.export import load_export
from replica.layout import StateLayout
from replica.mirror import Mirror, fetch_mirror
from replica.replicator import Replicator
from replica.resilient import ResilientProcessGroup, init_resilient_process_group
from replica.restore import restore_snapshot
from replica.rng import RNGState
from replica.snapshot import Snapshot
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
