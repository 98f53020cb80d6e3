"""The shard mirror: each trainer rank's state streamed after every step to a warm standby.

``replicator`` (``Replicator``: the trainer's side, its commits and redo checks), ``stream``
(the sender's stream of versions), ``standby`` (``Mirror``: the standby's receiver, and
``fetch_mirror``), ``repair`` (a standby's damaged buckets fetched again), ``warmup`` (a
standby's step run ahead of time, so that a promotion does not compile).

Layer: above ``replica.session``, ``replica.state``, ``replica.jobstore`` and
``replica.distributed``.
"""

from replica.mirror.replicator import Replicator
from replica.mirror.standby import Mirror, MirrorStats, fetch_mirror

__all__ = ["Mirror", "MirrorStats", "Replicator", "fetch_mirror"]
