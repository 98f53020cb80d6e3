"""The rollout data path at a real RL step's size (rollout_path_run.py, in a process of its
own): 256 prompts x 8 samples, 512-token prompts, 1,024-token completions, through two
stand-in engine processes (no model: each takes its tokens at a set rate) on the real serving
loop, desks and job store; beside the old store path's data movement for the same request and
a loopback socket's time for the same bytes (the physical limit here). `make bench` writes
bench/results/rollout_path.json and .md; `make test` runs it at 16 prompts x 2 (the code,
and the store's largest value, not the figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench_results import machine, write_results

HERE = Path(__file__).parent
FULL = {"prompts": 256, "samples": 8, "prompt_tokens": 512, "tokens": 1024, "engines": 2, "rate": 20_000, "rounds": 3}
SMOKE = {"prompts": 16, "samples": 2, "prompt_tokens": 32, "tokens": 64, "engines": 2, "rate": 50_000, "rounds": 1}
TARGET = 0.02  # the path's share of a step's rollout time (issue 60)


def test_rollout_path(benchmark, tmp_path):
    size = SMOKE if benchmark.disabled else FULL
    out = tmp_path / "rollout_path.json"
    proc = subprocess.run(
        [sys.executable, str(HERE / "rollout_path_run.py"), *(str(v) for v in size.values()), str(out)],
        timeout=1800,
        cwd=HERE,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    r = json.loads(out.read_text())
    assert len(r["paced_all_s"]) == len(r["instant_all_s"]) == size["rounds"]
    assert r["step_s"] >= r["generation_s"] > 0 and r["path_s"] > 0 and r["loopback_s"] > 0
    assert 0 < r["largest_store_value"] <= 64 << 10  # no store value grows with the step (asserted in the run too)
    benchmark.extra_info.update(r)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)  # the timings come from the run above
    if benchmark.disabled:
        return
    mb = (r["bytes"]["prompts"] * r["engines"] + r["bytes"]["completions"]) / 1e6
    write_results(
        "rollout_path",
        {**r, "target_path_share": TARGET, "machine": machine()},
        [
            f"| {r['prompts']} prompts x {r['samples']} samples, {r['prompt_tokens']}+{r['tokens']} tokens, "
            f"{r['engines']} stand-in engines at {r['rate_tokens_per_s']:.0f} tokens/s | median of {r['rounds']} |",
            "|---|---|",
            f"| generation alone (the slowest engine's tokens at the rate) | {r['generation_s']:.2f} s |",
            f"| a step's rollouts through the path | {r['step_s']:.2f} s: the path adds {r['path_share']:.2%} "
            f"(target <= {TARGET:.0%}) |",
            f"| the path alone (engines taking no time; their making of tokens {r['make_s']:.2f} s inside) | "
            f"{r['path_s']:.3f} s |",
            f"| the old store path's data movement for the same request (JSON through the TCPStore) | "
            f"{r['store_path_s']:.3f} s |",
            f"| the same {mb:.1f} MB over a loopback socket (the physical limit here) | {r['loopback_s']:.3f} s |",
            f"| the largest value written to the job store | {r['largest_store_value']} B (limit 65,536) |",
        ],
    )
