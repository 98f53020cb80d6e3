"""A process group that survives a member's replacement (``ResilientProcessGroup``)."""

from replica.distributed.resilient import BACKEND_NAME, ResilientProcessGroup, init_resilient_process_group

__all__ = ["BACKEND_NAME", "ResilientProcessGroup", "init_resilient_process_group"]
