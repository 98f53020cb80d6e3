"""A rank's training state: what it is, how it is packed, restored and exported.

``layout`` (which tensors, at which offsets: ``StateLayout``), ``placement`` (where the
packed state lives), ``snapshot`` (one step's packed copy: ``Snapshot``), ``serialize``
(the extras' codec), ``rng`` (``RNGState``), ``data`` (the data position: ``Batches``),
``restore`` (a snapshot back into a model and optimizer), ``export`` (safetensors files
of a committed step), ``divergence`` (what a redone step that did not reproduce records).

Layer: uses ``replica.transport`` and the shared bottom (``errors``, ``ops``); knows
nothing of the job store, the sessions or the roles.
"""

from replica.state.data import Batches
from replica.state.export import load_export
from replica.state.layout import StateLayout
from replica.state.restore import restore_snapshot
from replica.state.rng import RNGState
from replica.state.snapshot import Snapshot

__all__ = ["Batches", "RNGState", "Snapshot", "StateLayout", "load_export", "restore_snapshot"]
