"""Start a fresh vLLM engine from a model folder on disk and write its greedy
tokens and first-token log-probabilities for the test prompts as JSON (its own
process: vLLM keeps process-global state that a second in-process engine
would tear down when it goes)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vllm_engine import greedy, make_llm  # noqa: E402

if __name__ == "__main__":
    tokens, first = greedy(make_llm(Path(sys.argv[1])))
    Path(sys.argv[2]).write_text(json.dumps({"tokens": tokens, "first": [list(f.items()) for f in first]}))
