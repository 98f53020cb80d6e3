"""Spare standbys (`replica launch --spares N`): started ahead, bound to no rank, bound to a
rank that loses its standby instead of a new process started for it; training does not wait
for them. A real job (`replica launch`, the FSDP2 example)."""

from __future__ import annotations

import statistics
import time

import torch.distributed as dist

from replica.jobstore import JobStore, Stamp, keys
from replica.roles.report import compare_reports
from replica.roles.spares import SparePool
from support.launch import STEPS, launch


class _Host:
    """Where the pool's spares go, as an agent answers (``tests`` of the pool's own logic; the
    agents themselves run in the job tests: here, `replica launch`; tests/test_hosts.py and
    tests/test_ray.py, `replica agent` and Ray). Refuses ``refuse`` starts first (trainers
    still joining); ``replacements`` as --replacements."""

    def __init__(self, *, refuse: int = 0, replacements: int = -1):
        self.refuse, self.replacements, self.started = refuse, replacements, []

    def start_spare(self, index: int) -> bool:
        if self.refuse:
            self.refuse -= 1
            return False
        self.started.append(index)
        return True

    def take_replacement(self) -> bool:
        if self.replacements == 0:
            return False
        self.replacements -= 1
        return True

    def spare_of(self, pid: int, host: str | None) -> int | None:
        return pid - 1000 if pid >= 1000 and host == "h" else None  # spare N runs as pid 1000 + N on host h


def test_the_pool_places_spares_when_it_can_binds_ready_ones_and_refills():
    store = JobStore(dist.HashStore(), token=b"t")
    host = _Host(refuse=1, replacements=1)
    pool = SparePool(store, 2, host)
    assert host.started == [] and pool.free == set()  # refused: asked again after SPARE_RETRY, not at once
    pool.tick()
    assert host.started == []
    pool._retry = pool._retry.now()  # the retry is due
    pool.tick()
    assert host.started == [0, 1] and pool.free == {0, 1}
    assert pool.bind(3) is None  # none ready yet: a new process is started instead
    store.put(keys.spare_ready(1), Stamp(at=time.time()))
    assert pool.bind(3) == 1 and store.get(keys.spare_binding(1)).value == 3
    assert host.started == [0, 1, 2] and pool.free == {0, 2}  # refilled: the one replacement allowed
    store.put(keys.spare_ready(0), Stamp(at=time.time()))
    assert pool.bind(0) == 0 and host.started == [0, 1, 2]  # no replacement left: no refill
    assert [(b["rank"], b["spare"]) for b in pool.bound] == [(3, 1), (0, 0)]
    # A free spare's exit is the pool's; a bound one's is its rank's standby's; others are members'.
    assert pool.exited(1002, "h") and pool.free == set()
    assert not pool.exited(1001, "h") and not pool.exited(1002, "other") and not pool.exited(7, "h")


def _durations(report: dict, rank: str = "0") -> dict[int, float]:
    """Each step's seconds on ``rank`` (from the previous step's end), by step."""
    ends = report["step_end_times"][rank]
    return {
        step: b - a
        for step, (a, b) in enumerate(zip(ends, ends[1:], strict=False), start=2)
        if a is not None and b is not None
    }


def test_a_spare_becomes_the_new_standby_and_training_does_not_wait(tmp_path, reference):
    """Trainer 1 is killed in the backward of step 3: its standby is promoted, and the ready
    spare becomes rank 1's new standby; no new process is started (--replacements 0). Rank 1
    trains on meanwhile, unprotected until the spare holds its state: steps 4 and 5 take about a
    normal step each, where one of them used to wait in commit() for the new standby (1.4 s here
    against steps of 40-60 ms, with a replacement process started in milliseconds). Trainer 0
    stalls 8 s in steps 6 and 7 (below gloo's 10 s timeout) to leave the spare time to build its
    model (on a loaded machine 9 s were not enough); trainer 1, held in the same collectives,
    streams it the rank's state after step 7; then trainer 1 is killed again in step 10, and the
    former spare is promoted: the run stays bit-identical."""
    code, report, output = launch(
        tmp_path,
        "--spares",
        "1",
        "--replacements",
        "0",
        "--inject",
        "kill:trainer:1@3:backward,stall:trainer:0@6:8,stall:trainer:0@7:8,kill:trainer:1@10:backward",
    )
    assert code == 0, output[-4000:]
    assert all(f["fired_at"] is not None for f in report["faults"]), report["faults"]
    assert [(b["rank"], b["spare"]) for b in report["spares_bound"]] == [(1, 0)], report["spares_bound"]
    assert "spare 0 is rank 1's new standby" in output, output[-4000:]
    assert [f["rank"] for f in report["failovers"]] == [1, 1]  # the second promoted the former spare
    first = report["unprotected_spans"][0]
    assert first["rank"] == 1 and first["until_commit"] is not None, report["unprotected_spans"]
    killed = report["faults"][0]["fired_at"]
    print(f"kill -> rank 1 protected again by the spare: {first['until_at'] - killed:.2f} s")
    assert compare_reports(reference, report) == []
    assert report["last_commit"] == STEPS
    steps = _durations(report)
    normal = statistics.median(steps.values())
    # The target is two normal steps; asserted at 5x that (a loaded machine), far below a new
    # standby's start (seconds, against a step of tens of milliseconds here).
    assert max(steps[4], steps[5]) <= 10 * normal, (steps, normal)
    print(
        f"steps 4 and 5 (after the failover) {steps[4] * 1e3:.0f} and {steps[5] * 1e3:.0f} ms, a normal step "
        f"{normal * 1e3:.0f} ms"
    )
