"""Every key of the job state, with the type of its value: built here and nowhere
else, relative to the job's prefix (``Config.store_prefix``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic

from replica.jobstore.codec import T
from replica.jobstore.records import (
    Ack,
    AckSummary,
    AgentInfo,
    AgentOrder,
    Attempt,
    Commit,
    ExportOutcome,
    ExportRequest,
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
    ProcessLooks,
    Promotion,
    Registration,
    Regroup,
    RoleExit,
    ServedJob,
    Stamp,
    Text,
)

__all__ = ["Key", "attempt_prefix", "keys"]


@dataclass(frozen=True, slots=True)
class Key(Generic[T]):
    """A key of the schema (relative to the job's prefix) and the type of its value."""

    path: str
    value: type[T]

    def __str__(self) -> str:
        return self.path


def attempt_prefix(prefix: str, number: int) -> str:
    """The prefix of attempt ``number`` of the job whose own prefix is ``prefix`` (attempt 0's is
    that prefix): each attempt after a return to the durable floor has a fresh state of its own."""
    if number < 0:
        raise ValueError(f"an attempt's number is >= 0, got {number}")
    return prefix if number == 0 else f"{prefix}/attempt{number}"


class keys:
    """Every key of the job state. Counters (``count``) hold plain integers."""

    # coordinator -> everyone
    @staticmethod
    def generation() -> Key[Generation]:
        return Key("generation", Generation)

    @staticmethod
    def generation_number() -> Key[Number]:
        """The number of the generation record, written after it: a role that holds that
        record already reads this small key instead of the whole record (every rank's member)."""
        return Key("generation_number", Number)

    @staticmethod
    def failover(generation: int) -> Key[Failover]:
        return Key(f"failover/{generation}", Failover)

    @staticmethod
    def promote(rank: int) -> Key[Promotion]:
        return Key(f"promote/{rank}", Promotion)

    @staticmethod
    def members() -> Key[Text]:
        return Key("members", Text)  # the membership table as JSON, for people and reports

    @staticmethod
    def unprotected(rank: int) -> Key[Flag]:
        return Key(f"unprotected/{rank}", Flag)

    @staticmethod
    def coordinator() -> Key[Text]:
        return Key("coordinator", Text)  # the active coordinator's claim: every write it makes is fenced by it

    @staticmethod
    def coordinator_beat() -> Key[Number]:
        return Key("coordinator/beat", Number)  # the active coordinator's liveness counter

    @staticmethod
    def liveness() -> Key[Text]:
        return Key("coordinator/liveness", Text)  # "host:port" of the active coordinator's liveness endpoint (UDP)

    @staticmethod
    def served_job() -> Key[ServedJob]:
        """The job the host agents that serve job after job run (``replica agent --serve``), at the
        job's own prefix; written by its coordinator before it places the roles."""
        return Key("served_job", ServedJob)

    @staticmethod
    def attempt() -> Key[Attempt]:
        """The attempt in progress (absent: the first), read at the job's own prefix: the host agents
        start their roles again under the attempt's prefix (``attempt_prefix``) when it moves. At a
        later attempt's own prefix: how that attempt began (kept once the next one is named)."""
        return Key("attempt", Attempt)

    @staticmethod
    def finished() -> Key[Flag]:
        return Key("finished", Flag)

    @staticmethod
    def rollout_stop(index: int) -> Key[Flag]:
        return Key(f"rollout/{index}/stop", Flag)

    @staticmethod
    def engine_dead_since(index: int) -> Key[Stamp]:
        return Key(f"rollout/engine/{index}/dead_since", Stamp)

    # joins (the request carries its own HMAC; see replica.roles.join)
    @staticmethod
    def join_seq() -> str:
        return "join/seq"

    @staticmethod
    def join_request(seq: int) -> str:
        return f"join/{seq}"  # raw: the request carries an HMAC of its own

    @staticmethod
    def join_reply(seq: int) -> Key[JoinReply]:
        return Key(f"join/{seq}/reply", JoinReply)

    # the commit record
    @staticmethod
    def commit() -> Key[Commit]:
        return Key("commit", Commit)

    @staticmethod
    def commit_reached(step: int) -> str:
        """Raw, empty: written once the commit reached ``step`` (what commit waits block on;
        a hint, never trusted: the waiter reads the signed commit)."""
        return f"commit/reached/{step}"

    # Plain counters a writer adds one to after writing the keys it announces: the
    # coordinator reads a counter each poll and the keys themselves only when it moved
    # (hints: what the coordinator acts on is the signed keys).
    @staticmethod
    def done_count() -> str:
        return "done_count"  # after done/{rank}

    @staticmethod
    def regroup_count() -> str:
        return "regroup_count"  # after regroup/{rank}

    @staticmethod
    def lost_count() -> str:
        return "lost_count"  # after lost/{rank}

    @staticmethod
    def ack_count(step: int, group: int) -> str:
        """A plain counter: how many acknowledgements of ``step`` by ranks of ``group`` were
        written (a hint, see ``CommitRecord.acknowledge``; never trusted for the commit itself)."""
        return f"ack_count/{step}/{group}"

    @staticmethod
    def summary_count(step: int) -> str:
        """A plain counter: how many groups' summaries reached ``step`` (a hint likewise)."""
        return f"summary_count/{step}"

    @staticmethod
    def ack_summary(group: int) -> Key[AckSummary]:
        return Key(f"ack_summary/{group}", AckSummary)

    @staticmethod
    def ack(rank: int, holder: str) -> Key[Ack]:
        """The acks of one standby incarnation of ``rank`` (``holder``: its registration's
        nonce; "" for the rank's trainer acknowledging itself while unprotected)."""
        return Key(f"ack/{rank}/{holder or 'trainer'}", Ack)

    @staticmethod
    def standby(rank: int) -> Key[Registration]:
        return Key(f"standby/{rank}", Registration)

    @staticmethod
    def lost(rank: int) -> Key[LostReports]:
        return Key(f"lost/{rank}", LostReports)

    # roles -> coordinator
    @staticmethod
    def regroup(rank: int) -> Key[Regroup]:
        return Key(f"regroup/{rank}", Regroup)

    @staticmethod
    def agent(index: int) -> Key[AgentInfo]:
        return Key(f"agent/{index}", AgentInfo)

    @staticmethod
    def agent_beat(index: int) -> Key[Number]:
        return Key(f"agent/{index}/beat", Number)

    @staticmethod
    def agent_looks(index: int) -> Key[ProcessLooks]:
        """Host agent ``index``'s latest verdicts on its role processes (written with its beat)."""
        return Key(f"agent/{index}/looks", ProcessLooks)

    @staticmethod
    def agent_ended(index: int) -> Key[Flag]:
        """Host agent ``index`` saw the job's end (the coordinator keeps the store up until then)."""
        return Key(f"agent/{index}/ended", Flag)

    @staticmethod
    def agent_exits(index: int) -> str:
        return f"agent/{index}/exits"  # a counter: the number of exits it reported

    @staticmethod
    def agent_exit(index: int, n: int) -> Key[RoleExit]:
        return Key(f"agent/{index}/exit/{n}", RoleExit)

    @staticmethod
    def agent_orders(index: int) -> str:
        return f"agent/{index}/orders"  # a counter: the number of orders it was given

    @staticmethod
    def agent_order(index: int, n: int) -> Key[AgentOrder]:
        return Key(f"agent/{index}/order/{n}", AgentOrder)

    @staticmethod
    def heartbeat(member: int) -> Key[Heartbeat]:
        return Key(f"hb/{member}", Heartbeat)

    @staticmethod
    def liveness_reply(member: int) -> Key[LivenessReply]:
        return Key(f"hb/{member}/reply", LivenessReply)  # what an endpoint's answer is signed under (never stored)

    @staticmethod
    def export() -> Key[ExportRequest]:
        return Key("export", ExportRequest)

    @staticmethod
    def exported(rank: int, step: int) -> Key[ExportOutcome]:
        return Key(f"exported/{rank}/{step}", ExportOutcome)  # the answer to an ExportRequest of that step

    @staticmethod
    def fatal() -> Key[Text]:
        return Key("fatal", Text)

    # the durable floor (replica.mirror.floor): standbys -> everyone
    @staticmethod
    def floor_part(step: int, rank: int) -> Key[FloorPart]:
        return Key(f"floor/{step}/part/{rank}", FloorPart)

    @staticmethod
    def floor_parts(step: int) -> str:
        return f"floor/{step}/parts"  # a counter: the parts of that version written

    @staticmethod
    def floor_version(step: int) -> Key[FloorVersion]:
        return Key(f"floor/{step}/version", FloorVersion)  # its manifest: every part is written

    @staticmethod
    def floor_latest() -> Key[Number]:
        return Key("floor/latest", Number)  # the newest complete version (its manifest is written)

    @staticmethod
    def floor_planned() -> Key[Number]:
        return Key("floor/planned", Number)  # the next step to write, planned by rank 0's standby (the time cadence)

    @staticmethod
    def floor_errors() -> str:
        return "floor/errors"  # a counter: parts that could not be written

    @staticmethod
    def done(rank: int) -> Key[Flag]:
        return Key(f"done/{rank}", Flag)

    @staticmethod
    def loss(rank: int, step: int) -> Key[Text]:
        return Key(f"loss/{rank}/{step}", Text)  # "<loss hex> <time> <name>=<hex> ..."

    @staticmethod
    def divergence(rank: int, step: int, measure: str) -> Key[Text]:
        # replica.state.divergence.Divergence.to_json(); measure: "loss" or "state"
        return Key(f"divergence/{rank}/{step}/{measure}", Text)

    @staticmethod
    def spare_ready(index: int) -> Key[Stamp]:
        return Key(f"spare/{index}/ready", Stamp)  # spare standby INDEX waits for its rank

    @staticmethod
    def spare_binding(index: int) -> Key[Number]:
        return Key(f"spare/{index}/rank", Number)  # the rank the launcher bound spare INDEX to

    @staticmethod
    def killed(fault: str) -> Key[Stamp]:
        return Key(f"killed/{fault}", Stamp)

    @staticmethod
    def restored(generation: int) -> Key[Stamp]:
        return Key(f"restored/{generation}", Stamp)

    @staticmethod
    def reconnected(generation: int) -> Key[Stamp]:
        return Key(f"reconnected/{generation}", Stamp)

    @staticmethod
    def resumed(generation: int) -> Key[Stamp]:
        return Key(f"resumed/{generation}", Stamp)

    # weight sync and rollouts
    @staticmethod
    def engine(index: int) -> Key[Registration]:
        return Key(f"engine/{index}", Registration)

    @staticmethod
    def engine_version(index: int) -> Key[Number]:
        return Key(f"engine/{index}/version", Number)

    @staticmethod
    def engine_up(index: int) -> Key[Stamp]:
        return Key(f"rollout/engine/{index}/up", Stamp)

    @staticmethod
    def engine_desk(index: int) -> Key[Text]:
        return Key(f"rollout/engine/{index}/desk", Text)  # where the engine's desk listens (HOST:PORT)

    @staticmethod
    def version_seq() -> str:
        return "rollout/version_seq"

    @staticmethod
    def request_seq() -> str:
        return "rollout/seq"

    @staticmethod
    def version(generation: int, step: int) -> Key[Number]:
        return Key(f"rollout/version/{generation}/{step}", Number)

    @staticmethod
    def latest_version() -> Key[Number]:
        return Key("rollout/latest_version", Number)  # the newest version every trainer pushed

    @staticmethod
    def request_of(generation: int, step: int) -> Key[Number]:
        return Key(f"rollout/request/{generation}/{step}", Number)

    @staticmethod
    def kept_request(generation: int, step: int) -> Key[Number]:
        # The leader's word to every rank: STEP's rollouts are request N of an earlier generation (-1: none)
        return Key(f"rollout/kept/{generation}/{step}", Number)

    @staticmethod
    def rollout_seconds(step: int) -> Key[Text]:
        # The leader's seconds in STEP's push and generate (its last attempt), repr of a float: the report's split
        return Key(f"rollout/seconds/{step}", Text)

    @staticmethod
    def request(n: int) -> Key[Text]:
        return Key(f"rollout/req/{n}", Text)  # the request as JSON (its prompts are on the engines' desks)

    @staticmethod
    def claim(n: int, shard: int) -> Key[Text]:
        return Key(f"rollout/req/{n}/claim/{shard}", Text)  # "<engine>:<time>"

    @staticmethod
    def result(n: int, shard: int) -> Key[Text]:
        return Key(f"rollout/req/{n}/result/{shard}", Text)  # where the completions are (JSON)

    @staticmethod
    def reopened_seq() -> str:
        return "rollout/reopened_seq"

    @staticmethod
    def reopened(m: int) -> Key[Text]:
        # The m-th reopening (JSON: request, step, shards, their tokens made before): results lost with a desk
        return Key(f"rollout/reopened/{m}", Text)

    @staticmethod
    def request_seen(n: int) -> Key[Stamp]:
        return Key(f"rollout/req/{n}/seen", Stamp)

    @staticmethod
    def process_group() -> str:
        """The prefix under which the process groups rendezvous (torch's own keys, unsigned)."""
        return "pg"
