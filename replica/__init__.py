"""replica: checkpoint-free failover for FSDP trainers.

Every trainer rank's shard is mirrored after each optimizer step to a warm
standby; when a trainer dies, its standby is promoted and training resumes from
the last global commit. See README.md.
"""

from replica import errors, ops
from replica.errors import *  # noqa: F403  (the typed errors are top-level API)
from replica.layout import StateLayout
from replica.rng import RNGState

__version__ = "0.1.0"

__all__ = sorted([*errors.__all__, "RNGState", "StateLayout", "__version__", "ops"])
