"""Weight sync from CUDA parameters: packed on the GPU, copied straight into the pinned retained
host copy and sent from it. The engines receive exactly the bytes the host path
sends, the retained copy is byte for byte the host path's (alignment gaps included), and a
resend or a late engine is served from it. Then an FSDP2 model on CUDA whose full parameters
are gathered through the resilient group's NCCL generation. The receivers run on the host
over the gloo transport (no vLLM, no UCX needed).

On the H100: .venv/bin/python -m pytest tests/test_gpu_weights.py -v"""

from __future__ import annotations

import functools
import io
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

import replica
from replica.weights import WeightSync
from support.children import spawn
from support.weight_engine import EngineStandIn

pytestmark = pytest.mark.gpu

CONFIG = replica.Config(
    token=b"gpu-weights-token", bucket_bytes=8 << 10, timeout=timedelta(seconds=30), backends=("gloo",)
)


def make_model(device: str) -> nn.Module:
    """Mixed dtypes, tensors larger than a bucket, many buckets, sizes that leave alignment gaps."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(1000, 48),
        nn.Linear(48, 300),
        nn.LayerNorm(300),
        nn.Linear(300, 7),
        *(nn.Linear(7 if i == 0 else 40, 40) for i in range(6)),
    )
    model[2].to(torch.bfloat16)
    return model.to(device)


Engine = functools.partial(EngineStandIn, 0, config=CONFIG, wait=timedelta(seconds=60))


def raw(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["as-is", "to-bf16"])
def test_cuda_weights_arrive_as_the_host_path_sends_them(dtype):
    models = {"cpu": make_model("cpu"), "cuda": make_model("cuda")}
    stores = {device: dist.HashStore() for device in models}
    engines = {device: Engine(stores[device]) for device in models}
    syncs = {
        device: WeightSync(models[device], store=stores[device], num_engines=1, config=CONFIG, dtype=dtype)
        for device in models
    }
    try:
        num_buckets = len(syncs["cuda"]._buckets)
        assert num_buckets >= 6  # both staging slots are reused, more than once
        for step in (1, 2):
            if step == 2:  # new weights (the same on both), and a bad link on the CUDA side
                with torch.no_grad():
                    for p_cpu, p_cuda in zip(models["cpu"].parameters(), models["cuda"].parameters(), strict=True):
                        p_cpu.mul_(-1.5).add_(0.25)
                        p_cuda.copy_(p_cpu)
                syncs["cuda"].faults.corrupt_buckets = 2
            for device in models:
                assert syncs[device].push(step).engines_synced == [0], device
                assert engines[device].sync(step) == step
            assert torch.equal(syncs["cuda"]._packed, syncs["cpu"]._packed)  # every byte, gaps included
            for name, p in models["cpu"].named_parameters():
                expected = raw(p.to(dtype) if dtype is not None else p)
                assert raw(engines["cpu"].weights[name]) == expected, name
                assert raw(engines["cuda"].weights[name]) == expected, name  # bit for bit, casts included
        assert syncs["cuda"].faults.corrupted == 2 and syncs["cuda"].stats.resent_buckets == 2  # the fault fired
        assert syncs["cuda"].stats.staged_buckets == 2 * num_buckets  # every bucket took the device path
        assert syncs["cpu"].stats.staged_buckets == 0

        # A late engine is served from the retained copy, without the GPU.
        engines["cuda"].receiver.close()
        late = Engine(stores["cuda"])
        assert syncs["cuda"].refresh() == [0] and late.sync(2) == 2
        for name, p in models["cpu"].named_parameters():
            assert raw(late.weights[name]) == raw(p.to(dtype) if dtype is not None else p), name
        late.receiver.close()
    finally:
        for device in models:
            syncs[device].close()
            engines[device].receiver.close()


def _fsdp_trainer(pipe, port: int) -> None:
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        os.environ.pop(name, None)
    torch.cuda.set_device(0)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    group = replica.init_resilient_process_group(
        store=dist.PrefixStore("pg", store),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=30),
        nccl_timeout=timedelta(seconds=60),
    )
    seen: list[str] = []
    group.on_collective = seen.append
    model = make_model("cuda")
    mesh = init_device_mesh("cuda", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    sync = WeightSync(model, store=store, num_engines=1, config=CONFIG)
    stats = sync.push(1)
    expected = {name: p.to_local().detach().cpu().clone() for name, p in model.named_parameters()}
    blob = io.BytesIO()
    torch.save(expected, blob)  # plain bytes: the pipe's tensor sharing would need this process alive
    pipe.send(
        {
            "synced": stats.engines_synced,
            "staged": stats.staged_buckets,
            "buckets": len(sync._buckets),
            "collectives": sorted(set(seen)),
            "check": repr(group.check()),
            "expected": blob.getvalue(),
            "dtensor": all(hasattr(p, "full_tensor") for p in model.parameters()),
        }
    )
    sync.close()
    dist.destroy_process_group()


def test_fsdp2_cuda_weights_are_gathered_through_the_resilient_group():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    engine = Engine(store)
    try:
        with spawn(_fsdp_trainer, store.port, name="trainer") as child:
            report = child.recv(timeout=240)
        assert report["dtensor"], report  # the parameters were FSDP2 shards, gathered by WeightSync
        assert report["synced"] == [0] and report["check"] == "None", report
        assert report["staged"] == report["buckets"], report  # the device path
        assert any("gather" in c for c in report["collectives"]), report  # over the group's NCCL generation
        assert engine.sync(1) == 1
        expected = torch.load(io.BytesIO(report["expected"]))
        assert expected.keys() == engine.weights.keys()
        for name, t in expected.items():
            assert raw(engine.weights[name]) == raw(t), name
    finally:
        engine.receiver.close()
