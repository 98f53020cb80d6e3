"""replica.transport: the data plane.

Installed as ``replica.transport``. It may import only ``replica.errors`` and
``replica.ops`` from the package above it.
"""

from replica.transport.base import (
    MAX_TAG,
    After,
    Capabilities,
    Connection,
    Locality,
    MemoryKind,
    Transfer,
    Transport,
    select_transport,
)
from replica.transport.wire import BucketHeader

__all__ = [
    "After",
    "BucketHeader",
    "Capabilities",
    "Connection",
    "Locality",
    "MAX_TAG",
    "MemoryKind",
    "Transfer",
    "Transport",
    "select_transport",
]
