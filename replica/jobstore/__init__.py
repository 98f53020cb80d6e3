"""The job store: the signed schema of the job's control state and what is built on it.

* ``records``: the typed values (frozen dataclasses); ``codec``: their canonical JSON;
  ``keys``: every key and the type of its value;
* ``store``: ``JobStore``, which signs on write and verifies on read over a
  torch.distributed ``Store`` (a ``TCPStore``, or etcd through ``etcd``/``etcdwatch``;
  ``stores`` opens either from an address); ``heartbeat``: what sends a role's beats
  (``HeartbeatSender``; the beat itself is the record ``Heartbeat``);
* ``commit``: the global commit record (``CommitRecord``) and the epochs that fence it;
  ``registry``: where each rank's standby listens.

Layer: uses only ``replica.errors`` and the native ``replica._C`` below it; knows nothing
of the state, the sessions or the roles above it.
"""

from replica.jobstore.heartbeat import HeartbeatSender, ThreadHeartbeatSender
from replica.jobstore.keys import Key, attempt_prefix, keys
from replica.jobstore.records import (
    Ack,
    AckSummary,
    AgentInfo,
    AgentOrder,
    Attempt,
    Commit,
    Epoch,
    ExportOutcome,
    ExportRequest,
    ExportStatus,
    Failover,
    Flag,
    FloorPart,
    FloorVersion,
    Generation,
    Heartbeat,
    JoinReply,
    LivenessReply,
    LostReports,
    Number,
    OrderKind,
    ProcessLooks,
    Promotion,
    Registration,
    Regroup,
    RoleExit,
    ServedJob,
    Stamp,
    Text,
)
from replica.jobstore.store import JobStore

__all__ = [
    "Ack",
    "AckSummary",
    "AgentInfo",
    "AgentOrder",
    "Attempt",
    "Commit",
    "Epoch",
    "ExportOutcome",
    "ExportRequest",
    "ExportStatus",
    "Failover",
    "Flag",
    "FloorPart",
    "FloorVersion",
    "Generation",
    "Heartbeat",
    "HeartbeatSender",
    "JobStore",
    "JoinReply",
    "Key",
    "LivenessReply",
    "LostReports",
    "Number",
    "OrderKind",
    "ProcessLooks",
    "Promotion",
    "Registration",
    "Regroup",
    "RoleExit",
    "ServedJob",
    "Stamp",
    "Text",
    "ThreadHeartbeatSender",
    "attempt_prefix",
    "keys",
]
