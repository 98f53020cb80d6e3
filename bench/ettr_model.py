"""The arithmetic of bench/ettr.py, kept apart from the cluster so it can be
tested on its own: the failure schedule (Poisson arrivals over the job's
parts), ETTR and the other figures of a run from its step times, the
checkpoint interval a user would choose, and the projection to a 256-GPU job.

ETTR (effective training time ratio) = the time spent in the steps that count
toward the final model / the wall time, from the end of step 1 (both systems
start up once) to the end of the last step. A step counts once, in the run that
kept it (one redone after a rollback or a restart counts at its last run). A
step's time is the gap from the previous step's end to its own, less a
checkpoint save between them (saves are not steps); a gap that a failure fell
in is worth the run's own median undisturbed step instead (the step, not the
recovery). Measured against each run's own speed, so two runs on a machine
whose speed drifts by 15% between them (this one's does) compare what the
failures cost, not the drift."""

from __future__ import annotations

import enum
import math
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

__all__ = [
    "Failure",
    "Projection",
    "RunFigures",
    "Target",
    "TARGETS",
    "best_interval",
    "figures",
    "modelled_ettr",
    "poisson_schedule",
    "project",
    "step_time",
]


class Target(enum.StrEnum):
    TRAINER = "trainer"  # the process training rank INDEX (a promoted standby, after a failover)
    STANDBY = "standby"  # rank INDEX's standby process
    ROLLOUT = "rollout"  # vLLM engine INDEX's process
    HOST = "host"  # worker host INDEX + 1, whole: its link cut, then every process on it killed
    PAIR = "pair"  # rank INDEX's trainer and its standby at once (hosts that fail together: a switch)


TARGETS: Mapping[Target, int] = {
    Target.TRAINER: 2,
    Target.STANDBY: 2,
    Target.ROLLOUT: 3,
    Target.HOST: 5,
    Target.PAIR: 2,
}


@dataclass(frozen=True, kw_only=True)
class Failure:
    at_s: float  # after the failure clock started (the end of step 1)
    target: Target
    index: int

    def __str__(self) -> str:
        return f"{self.target}:{self.index}@{self.at_s:.1f}s"


def poisson_schedule(*, mtbf_s: float, horizon_s: float, seed: int) -> list[Failure]:
    """Failures arriving as a Poisson process (exponential gaps of mean ``mtbf_s``) up to
    ``horizon_s``; each picks a kind of target uniformly, then one of that kind."""
    if mtbf_s <= 0 or horizon_s < 0:
        raise ValueError(f"need mtbf_s > 0 and horizon_s >= 0, got {mtbf_s}, {horizon_s}")
    rng, at, out = random.Random(seed), 0.0, []
    while (at := at + rng.expovariate(1.0 / mtbf_s)) <= horizon_s:
        target = rng.choice(list(Target))
        out.append(Failure(at_s=round(at, 3), target=target, index=rng.randrange(TARGETS[target])))
    return out


def step_time(ends: Mapping[int, float], *, skip: set[int] = frozenset()) -> float:
    """The median gap between consecutive steps' ends (steps in ``skip`` left out: a
    checkpoint save after them)."""
    gaps = [ends[s] - ends[s - 1] for s in sorted(ends) if s - 1 in ends and s - 1 not in skip]
    if not gaps:
        raise ValueError("need two consecutive steps to measure a step time")
    return statistics.median(gaps)


@dataclass(frozen=True, kw_only=True)
class RunFigures:
    ettr: float
    wall_s: float
    useful_s: float  # the time spent in the steps that count
    step_s: float  # the run's own median undisturbed step (what a disturbed step is worth)
    steps_counted: int  # steps 2..last that the final model holds
    finished: bool
    recoveries_s: list[float]  # per failure that hit: the gap it fell in, less a step


def figures(
    *,
    ends: Mapping[int, float],
    steps: int,
    clock_start: float,
    stopped_at: float,
    interruptions: Sequence[float],
    saves: Mapping[int, float] | None = None,
    fallback_step_s: float,
) -> RunFigures:
    """A run's figures from the end time of each step in the final model (``ends``; a step
    redone counts at its last end), when it stopped (its last step's end when it finished;
    else when it was given up), when each failure hit (``interruptions``) and how long each
    checkpoint save took (``saves``: after that step). A step's time is the gap from the
    previous step's end to its own, less a save between them; a gap a failure fell in is
    worth the run's median undisturbed step instead (the step itself, not the recovery), and
    so is measured against this run's own speed, not another run's."""
    saves = saves or {}
    finished = all(s in ends for s in range(1, steps + 1))
    end = ends[steps] if finished else stopped_at
    wall = end - clock_start
    if wall <= 0:
        raise ValueError(f"the run ended ({end}) before its clock started ({clock_start})")
    gaps: dict[int, float | None] = {}
    for s in range(2, steps + 1):
        if s in ends and s - 1 in ends:
            low, high = ends[s - 1], ends[s]
            hit = any(low < t <= high for t in interruptions)
            gaps[s] = None if hit else max(0.0, high - low - saves.get(s - 1, 0.0))
    clean = [g for g in gaps.values() if g is not None]
    typical = statistics.median(clean) if len(clean) >= 5 else fallback_step_s
    useful = sum(typical if g is None else g for g in gaps.values())
    recoveries = []
    for t in interruptions:
        before = [e for e in ends.values() if e <= t]
        after = [e for e in ends.values() if e > t]
        if before and after:
            recoveries.append(max(0.0, min(after) - max(before) - typical))
    return RunFigures(
        ettr=min(1.0, useful / wall),
        wall_s=wall,
        useful_s=useful,
        step_s=typical,
        steps_counted=len(gaps),
        finished=finished,
        recoveries_s=recoveries,
    )


def modelled_ettr(*, interval: int, step_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """Checkpoint-restart's expected ETTR (first order, Young/Daly): a save of ``save_s``
    every ``interval`` steps; each failure costs a restart and, on average, half an
    interval of work redone."""
    period = interval * step_s + save_s
    lost = restart_s + period / 2
    return max(0.0, interval * step_s / period * (1 - lost / mtbf_s))


def best_interval(*, step_s: float, save_s: float, restart_s: float, mtbf_s: float, max_interval: int) -> int:
    """The checkpoint interval (steps) a user would choose: the one with the best
    modelled ETTR, from the measured step, save and restart times."""
    return max(
        range(1, max_interval + 1),
        key=lambda k: (modelled_ettr(interval=k, step_s=step_s, save_s=save_s, restart_s=restart_s, mtbf_s=mtbf_s), -k),
    )


@dataclass(frozen=True, kw_only=True)
class Projection:
    """A 256-GPU job, modelled from the parts measured here. Every field is an
    assumption, stated in the report beside its source."""

    trainer_hosts: int = 32
    gpus_per_host: int = 8
    params: float = 32e9  # a 32B dense policy
    state_bytes_per_param: int = 16  # bf16 weights + fp32 master, Adam m and v (mixed precision)
    step_s: float = 120.0  # one RL step (rollouts dominate)
    link_gb_s: float = 25.0  # a 200 Gbit/s NIC per host for the standby's resync
    storage_gb_s: float = 20.0  # the checkpoint store's aggregate write and read bandwidth
    restart_fixed_s: float = 300.0  # reschedule every pod, start processes, NCCL init, start vLLM engines
    detect_s: float = 2.5  # measured: the heartbeat deadline (a lost host)
    promote_s: float = 0.1  # measured: a standby's unpack
    reconnect_s: float = (
        10.0  # measured: gloo's collective timeout after a lost host; NCCL's rebuild at scale assumed alike
    )
    standby_start_s: float = 30.0  # a new standby's process and model on a rollout host
    wait_for_standby: bool = False  # commits wait for the new standby (replica's default; the bench trains on)
    control_s: float = 0.0  # a trainer's control-plane time per step (measured: make bench-scale), every step
    # The share of failures that lose a trainer host together with the host of its standbys (every in-memory
    # copy of its ranks). From Llama 3 405B's 419 interruptions in 54 days on 16k GPUs (Dubey et al. 2024,
    # table 5): network switch/cable, 8.4%, is the one cause there that takes more than one host at once;
    # counted fatal here (pessimistic: failure domains of single hosts, a trainer host and its standbys' host
    # under one switch). Host maintenance (7.6%) and the GPU, memory and software causes take one host.
    pair_fraction: float = 0.084
    # Failure domains (--domain, REPLICA_DOMAIN): with each trainer host's standbys under another switch than
    # it (switch-level domains), a switch takes trainer hosts whose standbys live on, or standbys whose
    # trainers do: ordinary failovers, all in one generation. A pair is then lost only where a second,
    # independent failure hits the partner host inside the first one's unprotected span (``pair_by_chance``).
    switch_domains: bool = False
    floor: bool = True  # a durable floor (--durable): a pair loss resumes from it; without, the job restarts
    floor_every_s: float = 600.0  # the floor's cadence (--durable-interval's default)
    floor_overhead: float = 0.0  # the floor's cost on a step, as a share of it (measured: bench/test_floor_cost.py)
    # The share of a step the engines spend generating (the rest: the trainers' forward, backward, optimizer).
    # Assumed: generation takes most of an RL step at this scale (long completions, a 32B policy); make
    # demo-rl's toy measures its own split (the report's rollout_split: 73-77%), no guide for a real model.
    rollout_share: float = 0.7
    # A redone step keeps its first attempt's request (roles/rollouts.py): the engines go on generating
    # through a trainer's failover, so only the training part in flight is redone.
    rollouts_kept: bool = True

    @property
    def state_gb(self) -> float:
        return self.params * self.state_bytes_per_param / 1e9

    def per_host_gb(self) -> float:
        return self.state_gb / self.trainer_hosts

    def failover_s(self) -> float:
        """A failure replica survives in memory: detect, promote, reconnect, redo the step in
        flight (``redone_s``), and, when commits wait for it, the new standby's start and
        resync."""
        lost = self.detect_s + self.promote_s + self.reconnect_s + self.redone_s()
        if self.wait_for_standby:
            lost += self.standby_start_s + self.per_host_gb() / self.link_gb_s
        return lost

    def redone_s(self) -> float:
        """The work a trainer's failure redoes, on average over where in the step it comes: half a
        step; with the rollouts kept, only the training part in flight: a failure during the
        rollouts loses none of them (the engines generate on through the failover, which is
        charged apart), one in the training part redoes what of it was done."""
        if not self.rollouts_kept:
            return self.step_s / 2
        train = self.step_s * (1 - self.rollout_share)
        return train * train / (2 * self.step_s)

    def floor_resume_s(self) -> float:
        """A pair loss with the floor: every role starts again (as a restart does), reads the
        floor's newest version and replays what came after it (half the cadence on average)
        and the step in flight."""
        return self.restart_fixed_s + self.state_gb / self.storage_gb_s + self.floor_every_s / 2 + self.step_s / 2

    def unprotected_s(self) -> float:
        """How long a rank is without a copy in memory after its trainer's or standby's failure:
        until its new standby (a fresh process, or a spare) holds its snapshot."""
        return self.standby_start_s + self.per_host_gb() / self.link_gb_s

    def pair_by_chance(self, mtbf_s: float) -> float:
        """The share of failures that lose a pair with no correlated cause: the next failure (the
        job's failures a Poisson process of mean ``mtbf_s``) comes inside this one's unprotected
        span and on its one partner host (group placement: a trainer host's standbys on one
        rollout host), of the 2 x trainer_hosts hosts."""
        return (1 - math.exp(-self.unprotected_s() / mtbf_s)) / (2 * self.trainer_hosts)

    def pair_share(self, mtbf_s: float) -> float:
        """The share of failures that lose every in-memory copy of some rank."""
        chance = self.pair_by_chance(mtbf_s)
        return chance if self.switch_domains else self.pair_fraction + (1 - self.pair_fraction) * chance

    def replica_ettr(self, mtbf_s: float) -> float:
        """Failures arrive every ``mtbf_s``; a share ``pair_fraction`` of them lose every copy of
        some ranks. With the floor those resume from it; without, the job is restarted from the
        user's own checkpoints, taken at the interval best for the pair losses' rate."""
        p = self.pair_share(mtbf_s)
        share = self.step_s / (self.step_s + self.control_s)
        if self.floor:
            lost = (1 - p) * self.failover_s() + p * self.floor_resume_s()
            return max(0.0, 1 - lost / mtbf_s) * share * (1 - self.floor_overhead)
        restarts = self.baseline_ettr(mtbf_s / p)[0] if p > 0 else 1.0
        return max(0.0, 1 - (1 - p) * self.failover_s() / mtbf_s) * restarts * share

    def restart_s(self) -> float:
        return self.restart_fixed_s + self.state_gb / self.storage_gb_s

    def save_s(self) -> float:
        return self.state_gb / self.storage_gb_s

    def baseline_ettr(self, mtbf_s: float) -> tuple[float, int]:
        """Checkpoint-restart at its best interval: (ETTR, interval in steps)."""
        k = best_interval(
            step_s=self.step_s, save_s=self.save_s(), restart_s=self.restart_s(), mtbf_s=mtbf_s, max_interval=10_000
        )
        return modelled_ettr(
            interval=k, step_s=self.step_s, save_s=self.save_s(), restart_s=self.restart_s(), mtbf_s=mtbf_s
        ), k


def project(model: Projection, mtbfs_s: Sequence[float]) -> list[dict]:
    rows = []
    for mtbf in mtbfs_s:
        baseline, k = model.baseline_ettr(mtbf)
        rows.append(
            {
                "mtbf_s": mtbf,
                "mtbf_steps": mtbf / model.step_s,
                "replica": model.replica_ettr(mtbf),
                "replica_without_floor": replace(model, floor=False).replica_ettr(mtbf),
                "replica_single_failures": replace(model, pair_fraction=0.0).replica_ettr(mtbf),
                "replica_switch_domains": replace(model, switch_domains=True).replica_ettr(mtbf),
                "replica_rollouts_redone": replace(model, rollouts_kept=False).replica_ettr(mtbf),
                "checkpoint_restart": baseline,
                "checkpoint_every": k,
            }
        )
    return rows
