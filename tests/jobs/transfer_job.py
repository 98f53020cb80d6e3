"""An engine started as users start it (vLLM's multi-process engine: the LLM's process, the
engine core's, the worker's) with ``weight_transfer_config={"backend": "replica"}``, and a
trainer in this process that pushes MODEL's weights through vLLM's own weight-transfer API
(``WeightTransferTrainerFactory.trainer_init`` -> ``send_weights``); writes the engine's
greedy tokens, first-token log-probabilities and weight version as JSON.

usage: transfer_job.py ENGINE_MODEL TRAINED_MODEL OUT [TP]
TP > 1: tensor parallel, each worker a receiver of its own (TP receivers in all).
TRAINED_MODEL "-": no push (the reference: a fresh engine of ENGINE_MODEL, the same way)."""

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # before vLLM is imported (make_llm sets 0 otherwise)
    os.environ["REPLICA_TOKEN"] = "transfer-job-token"  # the engine's workers read it from their environment
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from vllm import LLM
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from replica.integrations.vllm.transfer import LLMClient, ReplicaTrainerInitInfo
    from support.vllm_engine import greedy

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    tp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    llm = LLM(
        model=sys.argv[1],
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=32,
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=8,
        seed=0,
        weight_transfer_config={"backend": "replica"},
        tensor_parallel_size=tp,
    )
    synced, trainer = None, None
    if sys.argv[2] != "-":
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        trained = AutoModelForCausalLM.from_pretrained(sys.argv[2], torch_dtype="float32")
        trainer = WeightTransferTrainerFactory.trainer_init(
            ReplicaTrainerInitInfo(rank=0, store=f"127.0.0.1:{store.port}", engines=tp),
            client=LLMClient(llm),
            source=trained,
        )
        synced = trainer.send_weights(1).engines_synced
    tokens, first = greedy(llm)
    Path(sys.argv[3]).write_text(
        json.dumps(
            {
                "synced": synced,
                "version": llm.get_weight_version(),
                "engine_core": type(
                    llm.llm_engine.engine_core
                ).__name__,  # SyncMPClient: the engine in its own processes
                "tokens": tokens,
                "first": [list(f.items()) for f in first],
            }
        )
    )
    if trainer is not None:
        trainer.shutdown()
