"""A small FSDP2 training job for the demo, the multi-process tests and the benchmarks: a tiny
transformer with tied embeddings and one bfloat16 block, AdamW with a cosine
schedule, a shuffled loader whose position is Stateful, dropout and a numpy /
Python random augmentation, so every piece of mirrored state feeds the loss."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import replica

__all__ = [
    "Job",
    "JobShape",
    "ShuffledLoader",
    "TinyLM",
    "build_job",
    "deterministic_cuda",
    "role_device",
    "train_step",
]


@dataclass(kw_only=True, frozen=True, slots=True)
class JobShape:
    vocab: int = 256
    dim: int = 64
    heads: int = 4
    layers: int = 3
    seq: int = 32
    batch: int = 8  # per rank
    samples: int = 512
    total_steps: int = 20


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(att))
        return x + self.drop(self.mlp(self.norm2(x)))


class TinyLM(nn.Module):
    def __init__(self, shape: JobShape):
        super().__init__()
        self.embed = nn.Embedding(shape.vocab, shape.dim)
        self.blocks = nn.ModuleList(Block(shape.dim, shape.heads) for _ in range(shape.layers))
        self.blocks[-1].to(torch.bfloat16)  # one model, two parameter dtypes
        self.norm = nn.LayerNorm(shape.dim)
        self.head = nn.Linear(shape.dim, shape.vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            dtype = block.qkv.weight.dtype
            x = block(x.to(dtype)).float()
        return self.head(self.norm(x))


class ShuffledLoader:
    """Deterministic sequences, reshuffled every epoch; ``state_dict`` is its position."""

    def __init__(self, shape: JobShape, *, rank: int, world_size: int, seed: int = 1234):
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, shape.vocab, (shape.samples, 1), generator=g)
        stride = torch.randint(1, 7, (shape.samples, 1), generator=g)
        self.data = (start + stride * torch.arange(shape.seq + 1)) % shape.vocab
        self.shape, self.rank, self.world_size, self.seed = shape, rank, world_size, seed
        self.epoch = 0
        self.position = 0

    def _order(self) -> torch.Tensor:
        return torch.randperm(self.shape.samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.shape.batch * self.world_size
        if self.position + step > self.shape.samples:
            self.epoch, self.position = self.epoch + 1, 0
        ids = self._order()[self.position : self.position + step][self.rank :: self.world_size]
        self.position += step
        rows = self.data[ids]
        return rows[:, :-1], rows[:, 1:]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


@dataclass(kw_only=True, slots=True)
class Job:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    loader: ShuffledLoader
    device: torch.device = torch.device("cpu")

    @property
    def extra(self) -> dict:
        return {"loader": self.loader, "rng": replica.RNGState(), "scheduler": self.scheduler}


def deterministic_cuda() -> None:
    """CUDA settings under which a GPU run is repeatable bit for bit (call before any CUDA work):
    deterministic kernels, cuBLAS workspaces that do not depend on timing, and the math
    attention kernel (the fused ones' backward accumulates with atomics)."""
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)  # the repeatability test is the judge
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)


def role_device(kind: str) -> torch.device:
    """The device of this role's model: the CPU, or (``"cuda"``) GPU rank mod the GPUs
    visible, with ``deterministic_cuda``'s settings, made current before the process group
    (NCCL binds to it)."""
    if kind != "cuda":
        return torch.device("cpu")
    from replica.roles.env import RoleEnv

    deterministic_cuda()
    rank = RoleEnv.from_environ().rank  # before replica.roles.init(), which builds the process group
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def build_job(
    shape: JobShape, *, rank: int, world_size: int, fsdp: bool = True, seed: int = 0, device: str | torch.device = "cpu"
) -> Job:
    """The job's objects, freshly initialised on ``device``; sharded with FSDP2 over the
    default group when ``fsdp``."""
    device = torch.device(device)
    torch.manual_seed(seed)  # the same initial weights on every rank
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    model = TinyLM(shape).to(device)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    # foreach: AdamW's default on GPUs; on the CPU its per-parameter loop pays DTensor's dispatch once per
    # parameter and operation (most of a small job's optimizer step).
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=shape.total_steps)
    return Job(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=ShuffledLoader(shape, rank=rank, world_size=world_size),
        device=device,
    )


def train_step(job: Job, *, before_backward=None) -> torch.Tensor:
    x, y = job.loader.next_batch()
    if random.random() < 0.5:  # Python RNG
        x = x.clone()
        x[:, int(np.random.randint(0, x.shape[1]))] = 0  # numpy RNG
    x, y = x.to(job.device), y.to(job.device)
    loss = F.cross_entropy(job.model(x).flatten(0, 1), y.flatten())
    if before_backward is not None:
        before_backward(loss)
    loss.backward()
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    job.scheduler.step()
    return loss.detach()
