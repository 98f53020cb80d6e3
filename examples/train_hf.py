"""A training script written the way people write them: a Hugging Face causal LM (Qwen2,
built from a small config, random init: nothing is downloaded) under FSDP2 with a mixed-
precision policy, activation checkpointing, attention dropout, gradient accumulation,
``clip_grad_norm_``, a warm-up schedule, and a real data loader (torchdata's
``StatefulDataLoader``, or a plain ``DataLoader`` with a ``DistributedSampler``, with
workers) whose samples are randomly masked. Run by ``replica launch`` in every role:

    replica launch --allow-shared-domain --steps 12 --inject kill:trainer:1@5:optimizer --report run.json \\
        examples/train_hf.py --loader stateful

The loader goes into ``job.replicate`` with the rest of the state; the loop takes its
batches from ``job.next_batch("train")``. After a failover the next batch is the one the
failure-free run took, and the losses equal it bit for bit (``replica compare``).
``--unmirrored-noise`` plants a random draw from a generator that is *not* in the
mirrored state: the divergence guard catches the redo that differs. ``--compile layers|model``
compiles each decoder layer, or the whole sharded model; a standby runs one micro-step in
``job.warm_up`` while it waits, so that a promotion does not compile (``--no-warm-up``: it does,
and says so)."""

from __future__ import annotations

import argparse
import math

import torch
from fsdp_job import role_device  # beside this file
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import replica
import replica.roles

VOCAB, SEQ = 256, 16


class Sequences(Dataset):
    """Arithmetic token sequences, each drawn once from a fixed seed; ``__getitem__`` masks
    a random position (the global torch RNG: a worker's own seeded one with workers)."""

    def __init__(self, samples: int = 96):
        g = torch.Generator().manual_seed(1234)
        start = torch.randint(0, VOCAB, (samples, 1), generator=g)
        stride = torch.randint(1, 7, (samples, 1), generator=g)
        self.rows = (start + stride * torch.arange(SEQ + 1)) % VOCAB

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        row = self.rows[i].clone()
        row[int(torch.randint(0, SEQ, ()))] = 0  # random masking
        return {"input_ids": row[:-1], "labels": row[1:]}


def build_loader(kind: str, *, rank: int, world_size: int, workers: int, batch: int) -> DataLoader:
    data = Sequences()
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=7)
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(data, batch_size=batch, sampler=sampler, num_workers=workers)
    return DataLoader(data, batch_size=batch, sampler=sampler, num_workers=workers)


def build_model(device: torch.device, *, world_size: int, dropout: float, compile: str = "none"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)  # the same initial weights on every rank
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attention_dropout=dropout,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model = Qwen2ForCausalLM(config).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        if compile == "layers":
            layer.compile()  # per block, before sharding (torchtitan's order); names unchanged
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if compile == "model":
        return torch.compile(model)  # an OptimizedModule: its names gain "_orig_mod."
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--loader", choices=("stateful", "plain"), default="stateful")
    parser.add_argument("--workers", type=int, default=0, help="data loader worker processes")
    parser.add_argument("--batch", type=int, default=4, help="sequences per micro-batch and rank")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--dropout", type=float, default=0.1, help="attention dropout")
    parser.add_argument(
        "--unmirrored-noise",
        action="store_true",
        help="plant a random draw outside the mirrored state (the divergence guard must catch it)",
    )
    parser.add_argument(
        "--own-iterator",
        action="store_true",
        help="iterate the data loader directly, not through job.next_batch (against the README, but "
        "common): a redo after a failover takes other batches, and the divergence guard says so",
    )
    parser.add_argument(
        "--compile",
        choices=("none", "layers", "model"),
        default="none",
        help="torch.compile each decoder layer, or the whole sharded model",
    )
    parser.add_argument("--no-warm-up", action="store_true", help="let a promoted standby compile in its failover")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = role_device(args.device)
    job = replica.roles.init()
    total = job.env.steps  # replica launch --steps
    model = build_model(device, world_size=job.env.world_size, dropout=args.dropout, compile=args.compile)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)  # as on GPUs
    warmup = max(1, total // 4)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total))
    )
    loader = build_loader(
        args.loader, rank=job.rank, world_size=job.env.world_size, workers=args.workers, batch=args.batch
    )
    job.replicate(model, optimizer, {"train": loader, "scheduler": scheduler, "rng": replica.RNGState()})
    noise = torch.Generator().manual_seed(99 + job.rank)  # not mirrored: only with --unmirrored-noise

    def micro_step(batch: dict[str, torch.Tensor], planted: bool = False) -> torch.Tensor:
        out = model(input_ids=batch["input_ids"].to(device), labels=batch["labels"].to(device))
        loss = out.loss / args.accumulate
        if planted:
            loss = loss * (1 + 1e-3 * torch.rand((), generator=noise)).to(device)
        loss.backward()
        return loss.detach()

    # A standby compiles (and warms CUDA) now, on a sample batch of the real shapes, not in a failover.
    sample = torch.zeros(args.batch, SEQ, dtype=torch.long)
    if not args.no_warm_up:
        job.warm_up(lambda: micro_step({"input_ids": sample, "labels": sample}))
    own = None  # --own-iterator's

    def next_batch() -> dict[str, torch.Tensor]:
        nonlocal own
        if not args.own_iterator:
            return job.next_batch("train")
        try:
            return next(own) if own is not None else next(own := iter(loader))
        except StopIteration:  # a new epoch
            own = iter(loader)
            return next(own)

    for step in job.steps(total):
        total_loss = torch.zeros((), device=device)
        for _ in range(args.accumulate):
            total_loss += micro_step(next_batch(), planted=args.unmirrored_noise)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        job.log(step, total_loss)
        job.commit(step)


if __name__ == "__main__":
    main()
