"""The control-plane simulator (bench/control_scale.py) runs and its commit is right at
small N: every step's commit equals the step once every simulated rank acknowledged it
(the simulator asserts it), the per-step store requests stay O(N), and the report is
written. The large runs are `make bench-scale`."""

from __future__ import annotations

import json

import control_scale


def test_the_simulator_at_small_n(tmp_path, monkeypatch):
    monkeypatch.setattr(control_scale, "HEARTBEAT_SECONDS", 0.3)
    assert (
        control_scale.main(
            ["--n", "16", "--stores", "tcp", "--steps", "4", "--coordinator", "0", "--out", str(tmp_path)]
        )
        == 0
    )
    result = json.loads((tmp_path / "control_scale.json").read_text())
    runs = {r["n"]: r for r in result["runs"]}
    assert set(runs) == {16}  # (tests/test_commit_scale.py checks the growth with N)
    for n, run in runs.items():
        # O(N), <= 4N (issue 42's target): ~3 a rank (a standby's ack and counter, a trainer's read of
        # the commit; the generation checks answered by the beats' hint) and the raise's few
        assert run["requests_per_step"] <= 4 * n + 16, run
        assert run["largest_read_keys"] == n  # the one full read of the step
        assert run["heartbeat_writes_per_s"] > 0 and run["scans_per_s"] > 0
        # Native beats to the liveness endpoint: taken, answered, and none of them in the store.
        assert run["endpoint_datagrams_per_s"] > 0 and run["native_answers_per_s"] > 0, run
        assert run["native_store_writes"] == 0 and run["endpoint_rejected"] == 0, run
        assert run["overhead_1s_pct"] >= 0
    assert (tmp_path / "control_scale.md").read_text().count("| tcp |") == 1


def test_the_real_coordinator_under_simulated_members_and_its_successor():
    """The job's state in a real 3-member etcd (a TCPStore coordinator runs under every
    `replica launch` test). 2N members join through the real join path and beat; no member is
    declared dead while all beat; a killed trainer (its standby reports the connection gone)
    is found within its confirm time and a scan, a frozen one and a lost host's standbys within
    their deadline and a scan; the job goes on (the standbys hold the commit). Then the
    coordinator dies and a successor rebuilds the job from the store; the simulated roles find
    its liveness endpoint (their beats fall back to the store meanwhile, one each
    LIVENESS_STORE_PERIOD, with their stores' tokens) and none is declared dead over two deadlines."""
    import pytest

    from replica.roles import timing
    from support import etcd as testetcd

    if not testetcd.available():
        pytest.skip("etcd is not installed (make test installs etcd-server)")
    with testetcd.EtcdCluster(addresses=["127.0.0.1"] * 3) as cluster:
        address = f"etcd://{cluster.endpoints}/{cluster.namespace.rstrip('/')}"
        result = control_scale.run_coordinator(12, seconds=1.0, etcd=(address, cluster.environ()))
    deadline_ms = timing.Deadlines().trainer.total_seconds() * 1e3
    scan_ms = timing.BEAT_SCAN.total_seconds() * 1e3
    assert result["false_deaths"] == 0 and result["job_failed"] == [], result
    # 5x the targets: the kill's 300 ms confirm + a scan, the freeze's deadline + a scan
    assert result["detect_kill_ms"] is not None and result["detect_kill_ms"] < 5 * (300 + scan_ms), result
    for what in ("detect_freeze_ms", "detect_lost_host_ms"):
        # (from its last beat seen, up to a scan and a beat period before the fault was set)
        assert result[what] is not None and 0.8 * deadline_ms <= result[what] < 5 * (deadline_ms + scan_ms), result
    takeover = result["takeover"]
    assert takeover["members"] == 24 and takeover["alive"] == 24 - 10, takeover  # the 10 dead stay dead
    assert takeover["false_deaths"] == 0, takeover
