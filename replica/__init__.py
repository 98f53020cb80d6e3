"""replica: checkpoint-free failover for FSDP trainers.

Every trainer rank's shard is mirrored after each optimizer step to a warm
standby; when a trainer dies, its standby is promoted and training resumes from
the last global commit. See README.md and DESIGN.md.
"""

from replica import ops
from replica.errors import (
    AuthenticationError,
    LayoutMismatchError,
    PeerDisconnectedError,
    ReplicaError,
    TransferTimeoutError,
    TransportError,
)

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "LayoutMismatchError",
    "PeerDisconnectedError",
    "ReplicaError",
    "TransferTimeoutError",
    "TransportError",
    "__version__",
    "ops",
]
