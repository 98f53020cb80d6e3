"""replica.transport: the data plane (Transport ABC, UCX and CUDA IPC backends).

Installed as ``replica.transport``. It may import only ``replica.errors`` and
``replica.ops`` from the package above it; the backends arrive with the
transport issue.
"""

__all__: list[str] = []
