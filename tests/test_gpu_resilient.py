"""The resilient group's NCCL generations on one GPU. Two NCCL ranks cannot share a GPU, so
every group here has one member; what a dead peer does is stood in for by the two ways a
survivor's collective is failed: its communicator aborted (the coordinator's abort()) while
the collective is still queued, and NCCL's own watchdog timing it out. Each case runs in a
child process with a deadline, so a hang fails the test instead of stalling the run, and
reports what it saw phase by phase.

On the H100: .venv/bin/python -m pytest tests/test_gpu_resilient.py -v (about a minute)."""

from __future__ import annotations

import copy
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from replica.distributed.resilient import ResilientProcessGroup
from support.children import spawn

pytestmark = pytest.mark.gpu

_NCCL_ENV = (
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "NCCL_ASYNC_ERROR_HANDLING",
    "TORCH_NCCL_DUMP_ON_TIMEOUT",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC",
)


def _fresh_child() -> None:
    """What the group sets must be what these children run under, whatever the parent has."""
    for name in _NCCL_ENV:
        os.environ.pop(name, None)
    torch.cuda.set_device(0)


def _group(name: str, **kw) -> ResilientProcessGroup:
    return ResilientProcessGroup(
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=30),
        name=name,
        cuda=True,
        **{"nccl_timeout": timedelta(seconds=60), **kw},
    )


def _spin(seconds: float) -> None:
    """Keep the current stream busy for about ``seconds`` (a collective posted now queues behind it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**8)
    end.record()
    end.synchronize()
    cycles_per_ms = 10**8 / max(start.elapsed_time(end), 1e-3)
    torch.cuda._sleep(int(cycles_per_ms * seconds * 1000))


def _allreduce_ok(group: ResilientProcessGroup, value: float) -> bool:
    t = torch.full((1 << 16,), value, device="cuda")
    group.allreduce([t], dist.AllreduceOptions()).wait()
    torch.cuda.current_stream().synchronize()
    return bool((t == value).all())  # one member: the sum is the value


def _recover(group: ResilientProcessGroup, report: dict, start: float) -> None:
    """After a failed generation: the stream drains (the GPU got out of the failed
    collective) and the next generation works on the same GPU."""
    try:
        torch.cuda.current_stream().synchronize()
        report["drain_error"] = None
    except Exception as exc:  # noqa: BLE001 - reported to the test
        report["drain_error"] = repr(exc)
    report["drain_s"] = time.monotonic() - start
    group.configure(group.generation + 1)
    report["next_generation_ok"] = _allreduce_ok(group, 3.0) and group.check() is None
    group.shutdown()


def _generations(pipe) -> None:
    _fresh_child()
    group = _group("gpu-generations")
    report: dict = {}
    for generation in range(3):
        group.configure(generation)
        x = torch.arange(1 << 16, dtype=torch.float32, device="cuda") + generation
        gathered, scattered, reduced = torch.empty_like(x), torch.empty_like(x), x.clone()
        group._allgather_base(gathered, x, AllgatherOptions()).wait()
        group._reduce_scatter_base(scattered, x, dist.ReduceScatterOptions()).wait()
        group.allreduce([reduced], dist.AllreduceOptions()).wait()
        torch.cuda.current_stream().synchronize()
        report[generation] = {
            "results": [torch.equal(t, x) for t in (gathered, scattered, reduced)],
            "check": repr(group.check()),
            "tracked_after_check": len(group._works),
            "has_get_error": hasattr(group._inners["cuda"], "get_error"),
        }
    report["env"] = {name: os.environ.get(name) for name in _NCCL_ENV}
    start = time.monotonic()
    group.shutdown()
    report["shutdown_s"] = time.monotonic() - start
    pipe.send(report)


def test_nccl_generations_run_collectives_and_are_replaced():
    with spawn(_generations, name="generations") as child:
        report = child.recv(timeout=180)
    for generation in range(3):
        seen = report[generation]
        assert seen["results"] == [True, True, True], (generation, seen)  # all_gather, reduce_scatter, all_reduce
        assert seen["check"] == "None" and seen["tracked_after_check"] == 0, (generation, seen)
    assert report["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2", report["env"]  # a survivor is not killed
    assert report["env"]["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0", report["env"]
    assert report["shutdown_s"] < 30, report
    print(f"ProcessGroupNCCL.get_error available: {report[0]['has_get_error']}")


def _abort_queued(pipe) -> None:
    _fresh_child()
    group = _group("gpu-abort")
    group.configure(0)
    report: dict = {"warm": _allreduce_ok(group, 1.0)}  # the communicator exists before it is aborted
    _spin(3.0)
    queued = torch.ones(1 << 20, device="cuda")
    group.allreduce([queued], dist.AllreduceOptions()).wait()  # queued behind the spin, as a survivor's would be
    start = time.monotonic()
    group.abort("injected failover")  # as the heartbeat thread does: must return at once
    report["abort_call_s"] = time.monotonic() - start
    report["errored"] = repr(group.errored)
    report["aborted"] = group.abort("again", wait=timedelta(seconds=60))
    report["abort_s"] = time.monotonic() - start
    report["check"] = repr(group.check())
    _recover(group, report, start)
    pipe.send(report)


def test_abort_with_a_collective_queued_returns_and_the_next_generation_works():
    with spawn(_abort_queued, name="abort-queued") as child:
        report = child.recv(timeout=240)
    assert report["warm"], report
    assert report["abort_call_s"] < 1.0, report  # never blocks its caller (the heartbeat thread)
    assert "injected failover" in report["errored"] and "injected failover" in report["check"], report
    assert report["aborted"], report  # ncclCommAbort itself returned within 60 s
    assert report["drain_error"] is None, report  # the CUDA context survives the abort
    assert report["next_generation_ok"], report
    print(f"abort: {report['abort_s']:.2f} s, stream drained after {report['drain_s']:.2f} s")


def _watchdog_timeout(pipe) -> None:
    _fresh_child()
    group = _group("gpu-timeout", nccl_timeout=timedelta(seconds=2))
    group.configure(0)
    report: dict = {"warm": _allreduce_ok(group, 1.0)}
    _spin(8.0)
    queued = torch.ones(1 << 20, device="cuda")
    group.allreduce([queued], dist.AllreduceOptions()).wait()  # times out at 2 s, still queued behind the spin
    start = time.monotonic()
    while group.check() is None and time.monotonic() - start < 90:
        time.sleep(0.1)
    report["found_s"] = time.monotonic() - start
    report["errored"] = repr(group.errored)
    time.sleep(3.0)  # under torch's default handling the watchdog would have killed this process by now
    report["alive_after_s"] = time.monotonic() - start
    _recover(group, report, start)
    pipe.send(report)


def test_watchdog_timeout_is_found_by_check_and_does_not_kill_the_survivor():
    with spawn(_watchdog_timeout, name="watchdog-timeout") as child:
        report = child.recv(timeout=240)  # a dead child (killed by the watchdog) raises ChildFailed here
    assert report["warm"], report
    assert report["errored"] != "None" and report["found_s"] < 90, report  # the timeout reached the group
    assert report["drain_error"] is None and report["next_generation_ok"], report
    print(f"watchdog timeout seen by check() after {report['found_s']:.1f} s: {report['errored']}")


def _fsdp_step(pipe) -> None:
    _fresh_child()
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import replica

    group = replica.init_resilient_process_group(
        store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30), nccl_timeout=timedelta(seconds=60)
    )
    seen: list[str] = []
    group.on_collective = seen.append
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).cuda()
    model = copy.deepcopy(reference)
    mesh = init_device_mesh("cuda", (1,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(16, 32, device="cuda"), torch.randn(16, 8, device="cuda")) for _ in range(3)]

    def step(m, o, x, y, *, apply: bool = True) -> torch.Tensor:
        loss = F.mse_loss(m(x), y)
        loss.backward()
        if apply:
            o.step()
        o.zero_grad(set_to_none=True)
        return loss.detach()

    report: dict = {"losses": [], "reference": []}
    for i, (x, y) in enumerate(batches):
        if i == 1:  # a failover in this step: the generation fails, the step is discarded and redone
            group.abort("injected failover")
            step(model, opt, x, y, apply=False)  # runs to its end on the failed generation, nothing raised
            torch.cuda.current_stream().synchronize()
            report["failed_step_check"] = repr(group.check())
            if hasattr(model, "reset_iter_state"):  # torch 2.13's FSDP2 has it, 2.11's does not
                model.reset_iter_state()
            group.configure(1)
        report["losses"].append(step(model, opt, x, y).item())
        report["reference"].append(step(reference, opt_ref, x, y).item())
        torch.cuda.current_stream().synchronize()
        report.setdefault("checks", []).append(repr(group.check()))
    report["max_diff"] = max(
        (p.to_local() - r).abs().max().item() for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    )
    report["fsdp_collectives"] = sorted(set(seen))
    # What FSDP2 calls on its mesh's group at world size > 1 (at 1, recent FSDP2 calls nothing):
    # torch.distributed's own functions, with CUDA tensors, through the registered group.
    seen.clear()
    mesh_group = mesh.get_group()
    x = torch.arange(1 << 12, dtype=torch.float32, device="cuda")
    gathered, scattered, reduced = torch.empty_like(x), torch.empty_like(x), x.clone()
    dist.all_gather_into_tensor(gathered, x, group=mesh_group)
    dist.reduce_scatter_tensor(scattered, x, group=mesh_group)
    dist.all_reduce(reduced, group=mesh_group)
    torch.cuda.current_stream().synchronize()
    report["dist_results"] = [torch.equal(t, x) for t in (gathered, scattered, reduced)]
    report["dist_collectives"] = sorted(set(seen))
    report["mesh_group_is_the_group"] = mesh_group is group
    report["generation"] = group.generation
    report["final_check"] = repr(group.check())
    dist.destroy_process_group()
    pipe.send(report)


def test_fsdp2_step_on_cuda_through_the_group_survives_a_failed_generation():
    """FSDP2 of world size 1 on CUDA over the group: a step on an aborted generation is
    discarded (reset_iter_state, next generation) and redone, and the weights end as in a run
    that never failed. torch.distributed's collectives reach the group's NCCL generation with
    CUDA tensors (recent FSDP2 skips its own at world size 1; they are printed)."""
    with spawn(_fsdp_step, name="fsdp") as child:
        report = child.recv(timeout=240)
    assert "injected failover" in report["failed_step_check"], report
    assert report["checks"] == ["None"] * 3 and report["generation"] == 1, report
    torch.testing.assert_close(report["losses"], report["reference"], rtol=1e-5, atol=1e-6)
    assert report["max_diff"] < 1e-5, report  # the redone step left the same weights as never failing
    assert report["mesh_group_is_the_group"], report
    assert report["dist_results"] == [True, True, True], report
    assert any("gather" in c for c in report["dist_collectives"]), report
    assert any("reduce_scatter" in c for c in report["dist_collectives"]), report
    assert report["final_check"] == "None", report
    print(f"FSDP2's own collectives through the group at world size 1: {report['fsdp_collectives']}")
