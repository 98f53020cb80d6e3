"""Every duration the control plane waits for or by, in one place and one unit
(``datetime.timedelta``). The data plane's (connection, transfer and commit
timeouts, the standby wait, the scrub) are ``replica.Config`` fields; the
deadlines after which a silent role is declared dead are ``Deadlines``, set per
job (``replica launch --heartbeat-deadline``). Why each value is what it is
stands beside it; docs/operations.md's "Deadlines" section explains them for users."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

__all__ = [
    "BEAT_SCAN",
    "COMMIT_WAIT",
    "COORDINATOR_STALL",
    "Deadlines",
    "EXPORT_WAIT",
    "FINISH_LINGER",
    "GONE_AFTER",
    "HEARTBEAT_IO",
    "HEARTBEAT_PERIOD",
    "JOIN_STRAGGLE",
    "LATE_REPORT",
    "LIVENESS_FRESH",
    "LIVENESS_REAIM",
    "LIVENESS_STORE_AFTER",
    "LIVENESS_STORE_PERIOD",
    "NCCL_TIMEOUT",
    "PROBE_EVERY",
    "PROCESS_GROUP_TIMEOUT",
    "PROMOTION_WAIT",
    "PYTHON_GRACE",
    "QUIET",
    "REPLACEMENT_WAIT",
    "ROLE_WAIT",
    "ROLLOUT_DESK_TIMEOUT",
    "ROLLOUT_ENGINES_WAIT",
    "ROLLOUT_POLL",
    "ROLLOUT_REFRESH",
    "ROLLOUT_STEAL_AFTER",
    "ROLLOUT_TIMEOUT",
    "SPARE_RETRY",
    "STALL_HOLD",
    "STALL_LOGGED",
    "STALL_MEMORY",
    "STANDBY_LOOK",
    "STANDBY_POLL",
    "STANDBY_QUIET_LOOK",
    "STANDBY_WAIT",
    "STORE_LOST",
    "SUPERVISE_POLL",
    "UNSIGNED_GRACE",
    "UNSIGNED_POLL",
]


@dataclass(kw_only=True, frozen=True, slots=True)
class Deadlines:
    """How long a live process may be silent (no heartbeat) before it is declared
    dead, per role, and the shorter silence that confirms a transport-level report
    (its standby saw its connection vanish). Heartbeats come every
    ``HEARTBEAT_PERIOD`` from a native thread on a store connection of their own,
    so a slow step, a blocking store wait or a loaded machine does not stop them:
    the longest silence measured with both cores kept busy was 0.76 s. A frozen
    trainer is declared dead ``trainer`` after its last beat."""

    trainer: timedelta = timedelta(seconds=2.5)
    standby: timedelta = timedelta(seconds=2.5)
    rollout: timedelta = timedelta(seconds=60)  # an engine may be busy in a long generation
    confirm: timedelta = timedelta(milliseconds=300)

    def __post_init__(self) -> None:
        for name in ("trainer", "standby", "rollout", "confirm"):
            value = getattr(self, name)
            if not isinstance(value, timedelta) or value <= timedelta(0):
                raise ValueError(f"the {name} deadline must be a positive datetime.timedelta, got {value!r}")

    def of(self, role: str) -> timedelta:
        return getattr(self, role)


# --- a role's liveness (replica.roles.runtime) ---
HEARTBEAT_PERIOD = timedelta(milliseconds=100)
HEARTBEAT_IO = timedelta(seconds=2)  # one beat's store call (or reconnect) at most
PYTHON_GRACE = timedelta(seconds=30)  # beats stop once the interpreter showed no life this long (a hang)
STORE_LOST = timedelta(seconds=10)  # the store unreachable this long: the coordinator is gone
# The beats go to the coordinator's liveness endpoint (UDP, replica._C.LivenessServer), not the store,
# once the role read its address (keys.liveness). Each answer carries the generation number.
# With no answer for LIVENESS_STORE_AFTER (10 beats: an endpoint out of reach, a coordinator that
# moved) a role's beats go to the store as well, and the coordinator reads the store's beat of
# every member it has not heard that long; the role reads the endpoint's address again every
# LIVENESS_REAIM while no answer comes.
LIVENESS_STORE_AFTER = timedelta(seconds=1)
# Meanwhile the store takes one beat in five (the datagrams go on every beat): a coordinator's death
# sends every role's beats to the store at once, and at 10 a second 1,024 ranks' were 20,000 writes a
# second, more than a 3-member etcd takes (its successor could not read them: false deaths). Five
# beats a 2.5 s deadline.
LIVENESS_STORE_PERIOD = timedelta(milliseconds=500)
LIVENESS_REAIM = timedelta(seconds=1)
# An answer this recent vouches for the generation number it carried: a role's checks of the
# generation (each step, each HEARTBEAT_PERIOD, a waiting standby's) ask the store only when it
# moved or no answer came this long (beats every 100 ms: two lost answers in a row).
LIVENESS_FRESH = timedelta(milliseconds=300)

# --- a role's waits on the coordinator ---
ROLE_WAIT = timedelta(seconds=120)  # a join's answer, a failover record, a failover or regroup after a failed step
STANDBY_LOOK = timedelta(milliseconds=250)  # a waiting standby looks for the job's end and export requests
# and this often while a fresh liveness answer says the generation did not move (1,024 waiting standbys
# looking every 250 ms were ~20,000 store requests a second): the end or an export is seen up to 1 s late
STANDBY_QUIET_LOOK = timedelta(seconds=1)
STANDBY_POLL = timedelta(milliseconds=10)  # and for its promotion (the next generation's failover record)
PROMOTION_WAIT = timedelta(days=30)  # in effect none: the job's end or the store's loss ends a standby's wait
UNSIGNED_GRACE = timedelta(seconds=1)  # a joiner waits this long for a signed reply beside an unverifiable one
UNSIGNED_POLL = timedelta(milliseconds=50)  # looking again meanwhile

# --- a role's data plane, as the runtime configures it ---
STANDBY_WAIT = timedelta(seconds=120)  # a trainer waits this long for a lost standby's replacement
SPARE_RETRY = timedelta(seconds=1)  # a spare not placed yet (trainers joining, no room) is asked for again
# The coordinator lets a rank train unprotected when its new standby is not up after this long (a
# replacement slow to start on a loaded machine), before its trainer's STANDBY_WAIT would end the job.
REPLACEMENT_WAIT = STANDBY_WAIT - timedelta(seconds=30)
# A commit waits on every rank's ack: on a rank waiting for its replacement standby too (seen: a 60 s
# commit timeout ended a job whose replacement was still on its way).
COMMIT_WAIT = STANDBY_WAIT + timedelta(seconds=30)
# gloo fails a frozen peer's collective at this timeout (then the step is redone); NCCL's watchdog must
# never beat the coordinator to declaring a peer dead: 60 s is >= 3x heartbeat deadlines up to 20 s.
PROCESS_GROUP_TIMEOUT = timedelta(seconds=10)
NCCL_TIMEOUT = timedelta(seconds=60)

# --- the coordinator ---
SUPERVISE_POLL = timedelta(milliseconds=20)  # its loop: joins, beats, exits, decisions
# How often the coordinator reads every member's heartbeat (one request for them all): a
# member's silence is measured as of the last read, so a deadline is met up to this late
# and a beat is never missed (2,048 keys read each poll were a whole core; bench-scale).
BEAT_SCAN = timedelta(milliseconds=200)
JOIN_STRAGGLE = timedelta(seconds=10)  # a join numbered but never written (its writer died) is skipped after this
LATE_REPORT = timedelta(seconds=1)  # a transport report this soon after a promotion may be about the predecessor
EXPORT_WAIT = timedelta(seconds=60)  # how long a failing job waits for its standbys' exports
# After the job's end the coordinator keeps its store up until every role has seen the end and
# left (no heartbeat for GONE_AFTER: beats come every 100 ms), FINISH_LINGER at most: a role that
# found the store gone first would take the end for the coordinator's death (ExitCode.COORDINATOR_LOST).
FINISH_LINGER = timedelta(seconds=10)
GONE_AFTER = timedelta(milliseconds=500)

# --- rollouts ---
ROLLOUT_POLL = timedelta(milliseconds=5)  # an engine looks for requests
ROLLOUT_STEAL_AFTER = timedelta(milliseconds=500)  # an unclaimed shard of another engine is taken after this
ROLLOUT_REFRESH = timedelta(milliseconds=50)  # the leader brings newly joined engines up to date while it waits
ROLLOUT_TIMEOUT = timedelta(seconds=600)  # a version or a request's completions
ROLLOUT_DESK_TIMEOUT = timedelta(seconds=30)  # one request to an engine's desk (prompts or completions)
# The job's first request waits this long at most for every engine it was started with (a vLLM
# engine takes tens of seconds to come up); then it goes on with those up, the others join later.
ROLLOUT_ENGINES_WAIT = timedelta(seconds=120)

# --- the judgement of a silence (replica.roles.liveness) ---
# A gap between the coordinator's polls (every SUPERVISE_POLL) longer than this is its own stall:
# the silence of every member in it is not counted (a poll's own work, up to this, is not one).
COORDINATOR_STALL = timedelta(milliseconds=250)
STALL_MEMORY = timedelta(minutes=2)  # its stalls are kept this long (longer than any deadline)
STALL_LOGGED = timedelta(seconds=1)  # and said in the log from this long
# A member silent past its deadline whose process runs (or waits in the kernel: a fork, reclaim, an
# fsync), or one of many silent together, is held as a stall this long at most, then declared dead.
STALL_HOLD = timedelta(seconds=15)
PROBE_EVERY = timedelta(milliseconds=250)  # a held member's process is looked at again this often
# Members silent this long (ten beats) count as silent together when more than one host's worth (or
# every member) are: a suspected stall of the machine, not that many deaths.
QUIET = timedelta(seconds=1)
