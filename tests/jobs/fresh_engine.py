"""Start a vLLM engine in a process of its own (vLLM keeps process-global
state that a second in-process engine would tear down when it goes) and write
its greedy tokens and first-token log-probabilities for the test prompts as
JSON.

usage: fresh_engine.py MODEL OUT
       fresh_engine.py MODEL OUT --receive STORE_PORT INDEX STEP TOKEN_HEX
The second form attaches a weight receiver that applies versions in place
(vLLM's ``reload_weights``, no staging), waits for version STEP and reports
what it serves then."""

import json
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.vllm_engine import greedy, make_llm

if __name__ == "__main__":
    llm = make_llm(Path(sys.argv[1]))
    out = {}
    if len(sys.argv) > 3 and sys.argv[3] == "--receive":
        from replica.integrations.vllm.worker import EngineWeights, ReceiverSpec

        port, index, step, token = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), sys.argv[7]
        weights = EngineWeights(
            llm, ReceiverSpec(index=index, store=f"127.0.0.1:{port}", token_hex=token, staged=False)
        )
        out["version"] = weights.wait(step, timedelta(seconds=120))
        out["staging"] = weights.staging
    tokens, first = greedy(llm)
    out.update(tokens=tokens, first=[list(f.items()) for f in first])
    Path(sys.argv[2]).write_text(json.dumps(out))
