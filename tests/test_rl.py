"""The toy RL loop (examples/rl_loop.py) under `replica launch --rollouts 3`:
real vLLM engines generate, FSDP2 trainers learn, weights are pushed in place
every step. A trainer killed in backward (its standby, co-located with rollout
1, is promoted, and that engine is retired) and rollout 0 killed while it
generates (the others take its shards, a replacement comes up) must leave
the per-step losses and rewards bit-identical to the failure-free run."""

from __future__ import annotations

import pytest

from replica.roles.report import compare_reports
from replica.testing import busy_cores
from test_launch import ROOT, launch
from vllm_engine import vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install -e .[vllm])")

RL = ROOT / "examples" / "rl_loop.py"
OPTIONS = ("--rollouts", "3", "--steps", "6")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    # Which engines serve which shards, and how many there are, does not change a single
    # completion: the reference runs on one engine and no standbys (cheaper).
    code, reference, output = launch(tmp_path_factory.mktemp("rl-reference"), "--rollouts", "1", "--standbys", "0",
                                     "--steps", "6", name="reference", script=RL)
    assert code == 0, output[-4000:]
    assert reference["last_commit"] == 6 and reference["failovers"] == []
    assert all(m.get("reward") for m in reference["metrics_hex"]["0"])  # every step scored its rollouts
    return reference


@pytest.mark.parametrize("loaded", [False, True], ids=["quiet", "two-busy-processes-per-core"])
def test_rl_loop_survives_a_trainer_and_a_rollout_kill(tmp_path, reference, loaded):
    """Loaded: two busy processes per core at normal priority for the whole run, as on a
    user's machine; no healthy role may be taken for dead."""
    with busy_cores(per_core=2 if loaded else 0) as load:
        code, report, output = launch(tmp_path, *OPTIONS, "--inject", "kill:rollout:0@2,kill:trainer:1@4:backward",
                                      script=RL)
        assert load.all_alive()  # the load lasted the whole run
    assert code == 0, output[-4000:]
    assert report["standbys_replaced"] == [], report["standbys_replaced"]  # no false death
    assert all(f["fired_at"] is not None for f in report["faults"])  # both faults fired
    assert [f["rank"] for f in report["failovers"]] == [1]
    assert [r["index"] for r in report["rollouts_lost"]] == [0]
    assert report["rollouts_retired"] == [1]  # the promoted standby's machine stopped its engine
    first, replacement = [m for m in report["members"] if m["role"] == "rollout" and m["rank"] == 0]
    assert first["state"] == "dead" and replacement["state"] != "dead"  # engine 0 was replaced
    # Every shard was made with exactly the weights pushed for it, whichever engine served it (a
    # replacement serves only once it holds them; it may come up after this short run ends).
    shards = report["rollout_shards"]
    assert all(s["version"] == s["needed"] for s in shards)
    assert {s["step"] for s in shards} == set(range(1, 7))
    assert compare_reports(reference, report) == []  # losses and rewards, bit for bit
    assert report["last_commit"] == 6
