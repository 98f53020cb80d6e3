"""A toy RL loop under `replica launch --rollouts N`: vLLM rollout engines
sample completions of token-id prompts, a rule scores them (the fraction of
tokens in a target set), and FSDP2 trainers take a GRPO-style policy-gradient
step; the weights are pushed into the engines in place before every step's
rollouts. The same file runs as every role (trainer, standby, rollout).

    replica launch --allow-shared-domain --trainers 2 --rollouts 2 --steps 50 --report rl.json examples/rl_loop.py

With ``--checkpoint-dir D --checkpoint-every K`` the trainers also save a
torch.distributed.checkpoint every K steps and start from the newest one in D
(``replica coordinator --standbys 0 --resume-step STEP``): the checkpoint-restart
baseline of bench/ettr.py, the same job as users run it today.
"""

import argparse
import os
import random
import tempfile
from pathlib import Path

import torch
from dcp_checkpoint import Checkpoints, add_arguments

import replica
import replica.roles
from replica.roles.env import Role
from replica.roles.rollouts import Sampling

VOCAB, HIDDEN, LAYERS = 256, 128, 2
PROMPTS, GROUP, PROMPT_LEN, MAX_TOKENS = 8, 4, 6, 8  # 8 prompts x 4 samples a step
SHARDS = 4
SEED = 0


def target(token: int) -> bool:
    """The rule the policy learns: tokens divisible by 4 score (a quarter of a random model's)."""
    return token % 4 == 0


def build_policy():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HIDDEN // 32,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).to(torch.float32)


def make_engine():
    """An in-process vLLM engine starting from the initial policy (saved to a private folder)."""
    folder = Path(tempfile.mkdtemp(prefix="replica-rl-policy-"))
    build_policy().save_pretrained(folder, safe_serialization=True)
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
        max_model_len=64,
        max_num_seqs=PROMPTS * GROUP,
        seed=0,
        **EngineWeights.ENGINE_ARGS,
    )


def prompts_of(step: int) -> list[list[int]]:
    rng = random.Random(step)
    return [[1] + [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN - 1)] for _ in range(PROMPTS)]


def grpo_loss(model, prompts, completions, advantages) -> torch.Tensor:
    """-advantage x log-likelihood of each completion, averaged over tokens."""
    ids = torch.tensor([p + c for p, c in zip(prompts, completions, strict=False)])
    logits = model(ids).logits[:, PROMPT_LEN - 1 : -1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, PROMPT_LEN:, None]).squeeze(-1)
    return -(torch.tensor(advantages)[:, None] * logp).mean()


def main() -> None:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description="the RL loop (see the module's docstring)")
    add_arguments(parser)
    checkpoints = Checkpoints.of(parser, parser.parse_args())
    job = replica.roles.init()
    if job.role == Role.ROLLOUT:
        job.serve_rollouts(make_engine)
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    total = job.env.steps  # replica launch --steps
    world = job.env.world_size
    model = build_policy()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)  # as on GPUs
    rollouts = job.rollout_client(model, num_shards=SHARDS)
    extra = {"rng": replica.RNGState()}
    if checkpoints is not None:
        checkpoints.restore(job, model, optimizer, extra)
    job.replicate(model, optimizer, extra)
    for step in job.steps(total):
        rollouts.push(step)  # the weights after step - 1, into every engine, in place
        prompts = [p for p in prompts_of(step) for _ in range(GROUP)]
        completions = rollouts.generate(
            prompts, Sampling(max_tokens=MAX_TOKENS, temperature=1.0, seed=step * 1000), step=step
        )
        rewards = [sum(map(target, c)) / MAX_TOKENS for c in completions]
        advantages = []
        for g in range(0, len(rewards), GROUP):  # group-relative: each prompt's samples against each other
            group = torch.tensor(rewards[g : g + GROUP])
            advantages += ((group - group.mean()) / (group.std() + 1e-6)).tolist()
        mine = slice(job.rank, None, world)
        loss = grpo_loss(model, prompts[mine], completions[mine], advantages[mine])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        job.log(step, loss, reward=sum(rewards) / len(rewards))
        job.commit(step)
        if checkpoints is not None:
            checkpoints.after(step, model, optimizer, extra, rank=job.rank)


if __name__ == "__main__":
    main()
