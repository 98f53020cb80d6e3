"""The arithmetic of the ETTR bench (bench/ettr_model.py); the bench itself runs
under `make ettr` (a cluster of hosts, tens of minutes)."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

import pytest
from ettr_model import (
    TARGETS,
    Projection,
    Target,
    best_interval,
    figures,
    modelled_ettr,
    poisson_schedule,
    project,
    step_time,
)


def test_the_schedule_is_poisson_with_the_asked_mean_and_fixed_by_its_seed():
    schedule = poisson_schedule(mtbf_s=10.0, horizon_s=20_000.0, seed=3)
    assert schedule == poisson_schedule(mtbf_s=10.0, horizon_s=20_000.0, seed=3)
    assert schedule != poisson_schedule(mtbf_s=10.0, horizon_s=20_000.0, seed=4)
    gaps = [b.at_s - a.at_s for a, b in zip(schedule, schedule[1:], strict=False)]
    assert 9.0 < statistics.mean(gaps) < 11.0, statistics.mean(gaps)
    # Exponential gaps: the standard deviation is the mean (a fixed period would give 0).
    assert 0.85 < statistics.stdev(gaps) / statistics.mean(gaps) < 1.15
    kinds = {t: sum(1 for f in schedule if f.target == t) / len(schedule) for t in Target}
    share = 1 / len(Target)  # each kind alike, pairs and hosts (correlated losses) among them
    assert all(0.8 * share < got < 1.2 * share for got in kinds.values()), kinds
    assert all(0 <= f.index < TARGETS[f.target] for f in schedule)
    assert all(0 < f.at_s <= 20_000.0 for f in schedule)
    with pytest.raises(ValueError):
        poisson_schedule(mtbf_s=0.0, horizon_s=1.0, seed=0)


def test_step_time_is_the_median_gap_and_leaves_out_the_steps_after_a_save():
    ends = {1: 10.0, 2: 11.0, 3: 12.0, 4: 15.0, 5: 16.0}  # a 2 s checkpoint save after step 3
    assert step_time(ends, skip={3}) == 1.0
    assert step_time({1: 0.0, 2: 2.0, 3: 6.0}) == 3.0
    with pytest.raises(ValueError):
        step_time({1: 0.0})


def test_ettr_counts_each_step_once_at_the_runs_own_speed():
    # 9 steps of 1 s; a failure hits at 14.5 s and step 6 ends 4 s late: the gap it fell in is
    # worth one step.
    ends = {s: 9.0 + s for s in range(1, 6)} | {s: 13.0 + s for s in range(6, 10)}
    fig = figures(ends=ends, steps=9, clock_start=10.0, stopped_at=0.0, interruptions=[14.5], fallback_step_s=9.9)
    assert fig.finished and fig.steps_counted == 8 and fig.wall_s == 12.0 and fig.step_s == 1.0
    assert fig.useful_s == 8.0 and fig.ettr == pytest.approx(8 / 12)
    assert fig.recoveries_s == [pytest.approx(4.0)]  # the 5 s gap, less a step
    # The same run on a machine twice as slow: the same ETTR (its own speed, not another run's).
    slow = figures(
        ends={s: 2 * t for s, t in ends.items()},
        steps=9,
        clock_start=20.0,
        stopped_at=0.0,
        interruptions=[29.0],
        fallback_step_s=9.9,
    )
    assert slow.ettr == pytest.approx(fig.ettr) and slow.step_s == 2.0
    # Checkpoint saves are not steps: 0.5 s after steps 3 and 6 of a clean run.
    saved = {s: 9.0 + s + 0.5 * (s > 3) + 0.5 * (s > 6) for s in range(1, 10)}
    fig = figures(
        ends=saved,
        steps=9,
        clock_start=10.0,
        stopped_at=0.0,
        interruptions=[],
        saves={3: 0.5, 6: 0.5},
        fallback_step_s=9.9,
    )
    assert fig.useful_s == pytest.approx(8.0) and fig.ettr == pytest.approx(8 / 9)
    # Not finished: measured at the stop, over the steps it has; too few steps: the fallback.
    part = figures(
        ends={1: 10.0, 2: 11.0}, steps=5, clock_start=10.0, stopped_at=20.0, interruptions=[], fallback_step_s=9.9
    )
    assert not part.finished and part.ettr == pytest.approx(1 / 10) and part.step_s == 9.9
    clean = figures(
        ends={s: 10.0 + s for s in range(1, 8)},
        steps=7,
        clock_start=11.0,
        stopped_at=0.0,
        interruptions=[],
        fallback_step_s=9.9,
    )
    assert clean.ettr == 1.0


def test_the_best_interval_follows_young_daly():
    # Young's interval: sqrt(2 * save * mtbf) = sqrt(2 * 2 * 400) = 40 s = 40 steps of 1 s.
    k = best_interval(step_s=1.0, save_s=2.0, restart_s=10.0, mtbf_s=400.0, max_interval=1000)
    assert 30 <= k <= 50, k
    at_k = modelled_ettr(interval=k, step_s=1.0, save_s=2.0, restart_s=10.0, mtbf_s=400.0)
    for other in (1, k // 4, 4 * k):
        assert modelled_ettr(interval=other, step_s=1.0, save_s=2.0, restart_s=10.0, mtbf_s=400.0) <= at_k
    # Failures faster than a restart: nothing counts.
    assert modelled_ettr(interval=1, step_s=1.0, save_s=0.1, restart_s=60.0, mtbf_s=30.0) == 0.0
    # Rarer failures: a longer interval.
    assert best_interval(step_s=1.0, save_s=2.0, restart_s=10.0, mtbf_s=40_000.0, max_interval=10_000) > k


def test_the_projection_falls_with_the_failure_rate_and_replica_stays_above():
    rows = project(Projection(), [3600 * 4, 3600, 900])
    assert [r["mtbf_s"] for r in rows] == [3600 * 4, 3600, 900]
    for name in ("replica", "checkpoint_restart"):
        values = [r[name] for r in rows]
        assert values == sorted(values, reverse=True) and all(0 <= v <= 1 for v in values)
    assert all(r["replica"] > r["replica_without_floor"] > r["checkpoint_restart"] for r in rows)
    assert Projection().per_host_gb() == pytest.approx(32e9 * 16 / 1e9 / 32)


def test_pair_losses_cost_a_resume_from_the_floor_or_a_restart_without_it():
    """A share of the failures lose every copy of some ranks (correlated: a switch takes a
    trainer host and its standbys' host): with the floor each costs a restart of the roles, the
    version's load and half the floor's cadence replayed; without, checkpoint-restart's ETTR at
    the pair losses' own rate multiplies replica's."""
    model = Projection()
    alone = replace(model, pair_fraction=0.0, standby_start_s=0.0, link_gb_s=float("inf"))  # no span unprotected
    assert alone.pair_share(3600) == 0.0
    single = model.detect_s + model.promote_s + model.reconnect_s + model.redone_s()
    assert alone.replica_ettr(3600) == pytest.approx(1 - single / 3600)  # no pair losses: failovers only
    assert replace(alone, floor=False).replica_ettr(3600) == pytest.approx(alone.replica_ettr(3600))
    resume = model.restart_fixed_s + model.state_gb / model.storage_gb_s + model.floor_every_s / 2 + model.step_s / 2
    assert model.floor_resume_s() == pytest.approx(resume)
    p = model.pair_share(3600)
    assert model.pair_fraction < p < model.pair_fraction + 0.001  # the correlated share and a little chance
    assert model.replica_ettr(3600) == pytest.approx(1 - ((1 - p) * single + p * resume) / 3600)
    without = replace(model, floor=False)
    assert without.replica_ettr(3600) == pytest.approx((1 - (1 - p) * single / 3600) * model.baseline_ettr(3600 / p)[0])
    assert replace(model, floor_every_s=model.step_s).replica_ettr(3600) > model.replica_ettr(3600)  # a tighter floor
    assert replace(model, floor_overhead=0.01).replica_ettr(3600) == pytest.approx(model.replica_ettr(3600) * 0.99)


def test_switch_domains_leave_only_pairs_lost_by_chance():
    """With standbys under another switch than their trainers, a switch's loss is ordinary
    failovers: a pair is lost only when the next failure hits the partner host inside the
    unprotected span (a Poisson process of the job's failures; one partner among 2 x hosts)."""
    model = replace(Projection(), switch_domains=True)
    span = model.standby_start_s + model.per_host_gb() / model.link_gb_s
    assert model.unprotected_s() == pytest.approx(span)
    for mtbf in (900, 1800, 3600):
        chance = (1 - math.exp(-span / mtbf)) / (2 * model.trainer_hosts)
        assert model.pair_share(mtbf) == pytest.approx(chance) and chance < 1e-3
        assert replace(model, switch_domains=False).pair_share(mtbf) == pytest.approx(
            model.pair_fraction + (1 - model.pair_fraction) * chance
        )
        hosts = replace(model, switch_domains=False).replica_ettr(mtbf)
        assert hosts < model.replica_ettr(mtbf) <= replace(model, pair_fraction=0.0).replica_ettr(mtbf) + 1e-12


def test_kept_rollouts_leave_a_trainers_failure_only_the_training_part_to_redo():
    """Without the kept rollouts a failure redoes half a step on average; with them, a failure
    during the rollouts (a share r of the step) redoes nothing of them and one in the training
    part redoes what of it was done: (1 - r)^2 / 2 of a step."""
    model = Projection()
    assert replace(model, rollouts_kept=False).redone_s() == pytest.approx(model.step_s / 2)
    assert model.redone_s() == pytest.approx(model.step_s * (1 - model.rollout_share) ** 2 / 2)
    assert replace(model, rollout_share=0.0).redone_s() == pytest.approx(model.step_s / 2)  # no rollouts: as before
    assert model.replica_ettr(1800) > replace(model, rollouts_kept=False).replica_ettr(1800)


def test_the_projection_takes_the_detection_measured_at_scale(tmp_path):
    """The 256-GPU projection's detection time is the control-plane simulator's (the real
    coordinator, a lost host) at the N nearest the projected ranks, when it ran."""
    import json

    from ettr_projection import measured_detection

    path = tmp_path / "control_scale.json"
    assert measured_detection(256, path) is None  # not run
    path.write_text(
        json.dumps(
            {
                "coordinator": [
                    {"n": 64, "detect_lost_host_ms": 2700.0},
                    {"n": 1024, "detect_lost_host_ms": 3700.0},
                    {"n": 256, "detect_lost_host_ms": None},
                ]
            }
        )
    )
    assert measured_detection(256, path) == (2.7, 64)  # 256's own found nothing: the nearest that did
    assert measured_detection(900, path) == (3.7, 1024)


def test_the_projection_takes_the_control_planes_time_per_step_measured_at_scale(tmp_path):
    """A trainer's control-plane time per step at the nearest simulated N (TCPStore), with any
    commit latency beyond a step, lowers the projected ETTR by its share of the step."""
    import json

    from ettr_projection import measured_control

    path = tmp_path / "control_scale.json"
    assert measured_control(256, 120.0, path) is None  # not run
    path.write_text(
        json.dumps(
            {
                "runs": [
                    {"store": "tcp", "n": 256, "trainer_ms_median": 2.0, "commit_ms_median": 30.0},
                    {"store": "etcd", "n": 256, "trainer_ms_median": 50.0, "commit_ms_median": 900.0},
                    {"store": "tcp", "n": 1024, "trainer_ms_median": 4.0, "commit_ms_median": 1500.0},
                ]
            }
        )
    )
    assert measured_control(300, 120.0, path) == (0.002, 256)
    assert measured_control(1000, 1.0, path) == pytest.approx((0.004 + 0.5, 1024))  # the commit 0.5 s late
    plain, loaded = Projection(), Projection(control_s=1.2)
    assert loaded.replica_ettr(3600) == pytest.approx(plain.replica_ettr(3600) * 120 / 121.2)
