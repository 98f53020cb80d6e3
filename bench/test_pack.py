"""Pack, unpack, checksum and pack_checksum throughput beside their baselines and
the memcpy limit, all measured in one run. `make bench` writes bench/results/pack.json
and bench/results/pack.md."""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import statistics
import time
from pathlib import Path

import pytest
import torch
from bench_results import write_results
from pack_cases import CHECKSUM_BLOCK, PACK_CHECKSUM_BLOCK, large_tensors, small_tensors

from replica import ops

# name -> (median seconds, payload bytes); filled by the benchmarks below.
_medians: dict[str, tuple[float, int]] = {}

TARGETS = {
    "pack_vs_memcpy": 0.9,
    "unpack_vs_memcpy": 0.9,
    "small_pack_vs_cat": 3.0,
    "small_pack_vs_memcpy": 0.5,
    "checksum_vs_memcpy": 1.0,
    "pack_checksum_vs_pack": 0.9,
    "small_pack_checksum_vs_pack": 0.9,
}


@pytest.fixture(scope="module")
def large():
    tensors = large_tensors()
    offsets, total = ops.aligned_offsets(tensors)
    out = torch.zeros(total, dtype=torch.uint8)
    flat = torch.randint(0, 256, (total,), dtype=torch.uint8)
    return tensors, offsets, out, flat


@pytest.fixture(scope="module")
def small():
    tensors = small_tensors()
    offsets, total = ops.aligned_offsets(tensors)
    out = torch.zeros(total, dtype=torch.uint8)
    payload = sum(t.numel() * t.element_size() for t in tensors)
    flat = torch.randint(0, 256, (payload,), dtype=torch.uint8)
    cat_out = torch.zeros(payload, dtype=torch.uint8)
    views = [t.reshape(-1).view(torch.uint8) for t in tensors]
    return tensors, offsets, out, flat, cat_out, views, payload


def _run(benchmark, name: str, nbytes: int, fn, rounds: int) -> None:
    benchmark.extra_info["bytes"] = nbytes
    benchmark.pedantic(fn, rounds=rounds, warmup_rounds=2, iterations=1)
    if not benchmark.disabled:
        _medians[name] = (benchmark.stats.stats.median, nbytes)


# --- large: 1,000 mixed tensors, 256 MiB ---


def test_large_pack(benchmark, large):
    tensors, offsets, out, _ = large
    _run(benchmark, "large_pack", _payload(tensors), lambda: ops.pack(tensors, out, offsets), 15)


def test_large_unpack(benchmark, large):
    tensors, offsets, out, _ = large
    ops.pack(tensors, out, offsets)
    _run(benchmark, "large_unpack", _payload(tensors), lambda: ops.unpack(out, tensors, offsets), 15)


def test_large_memcpy_copy(benchmark, large):
    _, _, out, flat = large
    n = flat.numel()
    _run(benchmark, "large_memcpy_copy_", n, lambda: out.copy_(flat), 15)


def test_large_memcpy_memmove(benchmark, large):
    _, _, out, flat = large
    n = flat.numel()
    _run(benchmark, "large_memcpy_memmove", n, lambda: ctypes.memmove(out.data_ptr(), flat.data_ptr(), n), 15)


def test_checksum(benchmark, large):
    _, _, _, flat = large
    _run(benchmark, "checksum", flat.numel(), lambda: ops.checksum(flat, CHECKSUM_BLOCK), 15)


@pytest.mark.parametrize("build", ops.simd_builds())
def test_checksum_build(benchmark, large, build):
    """Each CPU build of the checksum loops (the default one is test_checksum)."""
    _, _, _, flat = large
    previous = ops.select_simd_build(build)
    try:
        _run(benchmark, f"checksum_{build}", flat.numel(), lambda: ops.checksum(flat, CHECKSUM_BLOCK), 15)
    finally:
        ops.select_simd_build(previous)


def test_large_pack_checksum(benchmark, large):
    tensors, offsets, out, _ = large
    _run(
        benchmark,
        "large_pack_checksum",
        _payload(tensors),
        lambda: ops.pack_checksum(tensors, out, offsets, PACK_CHECKSUM_BLOCK),
        15,
    )


# --- small: 10,000 tensors of 256 B to 4 KiB ---


def test_small_pack(benchmark, small):
    tensors, offsets, out, _, _, _, payload = small
    _run(benchmark, "small_pack", payload, lambda: ops.pack(tensors, out, offsets), 40)


def test_small_pack_checksum(benchmark, small):
    tensors, offsets, out, _, _, _, payload = small
    _run(
        benchmark,
        "small_pack_checksum",
        payload,
        lambda: ops.pack_checksum(tensors, out, offsets, PACK_CHECKSUM_BLOCK),
        40,
    )


def test_small_cat(benchmark, small):
    _, _, _, _, cat_out, views, payload = small
    _run(benchmark, "small_cat", payload, lambda: torch.cat(views, out=cat_out), 40)


def test_small_memcpy_copy(benchmark, small):
    _, _, _, flat, cat_out, _, payload = small
    _run(benchmark, "small_memcpy_copy_", payload, lambda: cat_out.copy_(flat), 40)


def test_small_memcpy_memmove(benchmark, small):
    _, _, _, flat, cat_out, _, payload = small
    _run(
        benchmark,
        "small_memcpy_memmove",
        payload,
        lambda: ctypes.memmove(cat_out.data_ptr(), flat.data_ptr(), payload),
        40,
    )


def _payload(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# --- report ---


def _gbps(name: str) -> float:
    seconds, nbytes = _medians[name]
    return nbytes / seconds / 1e9


def _limit(prefix: str) -> tuple[float, str]:
    candidates = {f"{prefix}_copy_": "tensor.copy_", f"{prefix}_memmove": "C memcpy"}
    best = max(candidates, key=_gbps)
    return _gbps(best), candidates[best]


@pytest.fixture(scope="module", autouse=True)
def report():
    yield
    needed = {
        "large_pack",
        "large_unpack",
        "checksum",
        "small_pack",
        "small_cat",
        "large_pack_checksum",
        "small_pack_checksum",
        "large_memcpy_copy_",
        "large_memcpy_memmove",
        "small_memcpy_copy_",
        "small_memcpy_memmove",
    }
    if not needed <= _medians.keys():
        return  # benchmarks disabled (CI smoke run) or some were deselected
    large_limit, large_how = _limit("large_memcpy")
    small_limit, small_how = _limit("small_memcpy")
    ratios = {
        "pack_vs_memcpy": _gbps("large_pack") / large_limit,
        "unpack_vs_memcpy": _gbps("large_unpack") / large_limit,
        "small_pack_vs_cat": _gbps("small_pack") / _gbps("small_cat"),
        "small_pack_vs_memcpy": _gbps("small_pack") / small_limit,
        "checksum_vs_memcpy": _gbps("checksum") / large_limit,
        "pack_checksum_vs_pack": _gbps("large_pack_checksum") / _gbps("large_pack"),
        "small_pack_checksum_vs_pack": _gbps("small_pack_checksum") / _gbps("small_pack"),
    }
    rows = [
        (
            "pack, 1,000 mixed tensors, 256 MiB",
            "large_pack",
            f"memcpy limit ({large_how})",
            large_limit,
            "pack_vs_memcpy",
        ),
        ("unpack, same", "large_unpack", f"memcpy limit ({large_how})", large_limit, "unpack_vs_memcpy"),
        (
            "pack, 10,000 small tensors, ~21 MiB",
            "small_pack",
            "torch.cat(out=)",
            _gbps("small_cat"),
            "small_pack_vs_cat",
        ),
        ("pack, same", "small_pack", f"memcpy limit ({small_how})", small_limit, "small_pack_vs_memcpy"),
        (
            "checksum, 256 MiB in 1 MiB blocks",
            "checksum",
            f"memcpy limit ({large_how})",
            large_limit,
            "checksum_vs_memcpy",
        ),
        (
            "pack_checksum, 1,000 mixed tensors, 4 MiB blocks",
            "large_pack_checksum",
            "pack",
            _gbps("large_pack"),
            "pack_checksum_vs_pack",
        ),
        (
            "pack_checksum, 10,000 small tensors",
            "small_pack_checksum",
            "pack",
            _gbps("small_pack"),
            "small_pack_checksum_vs_pack",
        ),
    ]
    lines = [
        "| case | replica GB/s | beside | its GB/s | ratio | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, ours, beside, base, key in rows:
        met = "yes" if ratios[key] >= TARGETS[key] else "**no**"
        lines.append(
            f"| {case} | {_gbps(ours):.2f} | {beside} | {base:.2f} | {ratios[key]:.2f}x | >= {TARGETS[key]}x | {met} |"
        )
    machine = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "processor": _cpu_model(),
        "python": platform.python_version(),
    }
    builds = [name for name in ops.simd_builds() if f"checksum_{name}" in _medians]
    if builds:
        lines.append("")
        lines.append(
            "checksum by CPU build (256 MiB, 1 MiB blocks; in use: "
            + ops.simd_build()
            + "): "
            + ", ".join(
                f"{b} {_gbps(f'checksum_{b}'):.2f} GB/s ({_gbps(f'checksum_{b}') / large_limit:.2f}x memcpy)"
                for b in builds
            )
        )
    payload = {
        **ratios,
        "targets": TARGETS,
        "simd_build": ops.simd_build(),
        "gbps": {name: _gbps(name) for name in sorted(_medians)},
        "median_s": {name: s for name, (s, _) in sorted(_medians.items())},
        "machine": machine,
    }
    header = (
        f"### pack / unpack / checksum (medians; torch {machine['torch']}, {machine['threads']} threads, "
        f"{machine['processor']})\n"
    )
    write_results("pack", payload, [header, *lines])


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# --- GPU: pack / unpack / checksum of device memory beside a device copy_ ---
#
# Two figures per op. wall: the call until torch.cuda.synchronize() returns, host work
# included, as a caller that waits for the result sees it. device: CUDA events around the
# call, with a sleep kernel queued first so the GPU is still busy while the host prepares
# the call; they time only the GPU's own work. host: the time until the call returns.

GPU_TARGETS = {
    ("large", "pack"): 0.85,
    ("large", "unpack"): 0.85,
    ("large", "pack_checksum"): 0.85,
    ("small", "pack_checksum"): 0.85,
}
GPU_CASES = {
    "large": "1,000 mixed tensors, 256 MiB",
    "small": "10,000 tensors of 256 B to 4 KiB, ~21 MiB",
}
GPU_OPS = [("large", op) for op in ("pack", "unpack", "checksum", "pack_checksum", "copy_")] + [
    ("small", op) for op in ("pack", "unpack", "checksum", "pack_checksum", "copy_", "cat")
]

# (case, op) -> {"wall_s", "device_s", "host_s", "bytes"}
_gpu_results: dict[tuple[str, str], dict[str, float]] = {}


def _nvtx_range(name: str):
    try:
        import nvtx
    except ImportError:
        return contextlib.nullcontext()
    return nvtx.annotate(name)


@pytest.fixture(scope="module")
def large_cuda(large):
    tensors, offsets, out, flat = large
    out, flat = out.cuda(), flat.cuda()
    return {
        "tensors": [t.cuda() for t in tensors],
        "offsets": offsets,
        "out": out,
        "flat": flat,
        "payload": _payload(tensors),
        "copy_dst": out[: flat.numel()],
    }


@pytest.fixture(scope="module")
def small_cuda(small):
    tensors, offsets, out, flat, cat_out, _, payload = small
    tensors = [t.cuda() for t in tensors]
    out, flat = out.cuda(), flat.cuda()
    return {
        "tensors": tensors,
        "offsets": offsets,
        "out": out,
        "flat": flat,
        "payload": payload,
        "copy_dst": out[: flat.numel()],
        "cat_out": cat_out.cuda(),
        "views": [t.reshape(-1).view(torch.uint8) for t in tensors],
    }


def _gpu_call(c: dict, op: str):
    if op == "pack":
        return lambda: ops.pack(c["tensors"], c["out"], c["offsets"]), c["payload"]
    if op == "unpack":
        return lambda: ops.unpack(c["out"], c["tensors"], c["offsets"]), c["payload"]
    if op == "checksum":
        return lambda: ops.checksum(c["flat"], CHECKSUM_BLOCK), c["flat"].numel()
    if op == "pack_checksum":
        return lambda: ops.pack_checksum(c["tensors"], c["out"], c["offsets"], PACK_CHECKSUM_BLOCK), c["payload"]
    if op == "copy_":
        return lambda: c["copy_dst"].copy_(c["flat"]), c["flat"].numel()
    if op == "cat":
        return lambda: torch.cat(c["views"], out=c["cat_out"]), c["payload"]
    raise ValueError(op)


def _sleep_cycles_per_second() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 20_000_000
    torch.cuda._sleep(1000)  # load the kernel before timing it
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def _device_and_host_seconds(fn, wall_s: float, rounds: int = 20) -> tuple[float, float]:
    # The sleep outlasts the host's part of the call (at most the wall time) twice over.
    cycles = int(max(2 * wall_s, 1e-3) * _sleep_cycles_per_second())
    device, host = [], []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end) / 1e3)
    return statistics.median(device), statistics.median(host)


@pytest.mark.gpu
@pytest.mark.parametrize("case,op", GPU_OPS, ids=[f"{c}-{o}" for c, o in GPU_OPS])
def test_gpu(benchmark, request, case, op):
    c = request.getfixturevalue(f"{case}_cuda")
    fn, nbytes = _gpu_call(c, op)

    def synced():
        fn()
        torch.cuda.synchronize()

    benchmark.extra_info["bytes"] = nbytes
    with _nvtx_range(f"bench {case} {op}"):
        benchmark.pedantic(synced, rounds=30, warmup_rounds=3, iterations=1)
        if benchmark.disabled:
            return
        wall_s = benchmark.stats.stats.median
        device_s, host_s = _device_and_host_seconds(fn, wall_s)
    benchmark.extra_info.update(device_s=device_s, host_s=host_s)
    _gpu_results[(case, op)] = {"wall_s": wall_s, "device_s": device_s, "host_s": host_s, "bytes": nbytes}


@pytest.fixture(scope="module", autouse=True)
def report_gpu():
    yield
    cases = [case for case in GPU_CASES if (case, "copy_") in _gpu_results]
    if not cases:
        return  # no GPU, benchmarks disabled, or the baselines deselected
    figures = {}
    lines = [
        f"### GPU ({torch.cuda.get_device_name()}, torch {torch.__version__}): pack / unpack / checksum "
        "beside one device-to-device copy_ of the same bytes\n",
        "wall: the call until `torch.cuda.synchronize()` returns, host work included (median of 30); "
        "device: the GPU's own time, by CUDA events with the GPU kept busy while the host prepares "
        "the call; host: time until the call returns (medians of 20).\n",
        "| case | op | wall µs | wall GB/s | vs copy_ | device µs | device GB/s | vs copy_ | host µs | target |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        base = _gpu_results[(case, "copy_")]
        base_wall = base["bytes"] / base["wall_s"]
        base_device = base["bytes"] / base["device_s"]
        for case_op, r in _gpu_results.items():
            if case_op[0] != case:
                continue
            op = case_op[1]
            wall_ratio = r["bytes"] / r["wall_s"] / base_wall
            device_ratio = r["bytes"] / r["device_s"] / base_device
            target = GPU_TARGETS.get(case_op)
            verdict = "" if target is None else f">= {target}x: {'yes' if wall_ratio >= target else '**no**'}"
            figures[f"{case}_{op}"] = {
                **r,
                "wall_gbps": r["bytes"] / r["wall_s"] / 1e9,
                "device_gbps": r["bytes"] / r["device_s"] / 1e9,
                "wall_vs_copy": wall_ratio,
                "device_vs_copy": device_ratio,
                "target_wall_vs_copy": target,
            }
            lines.append(
                f"| {GPU_CASES[case]} | {op} | {r['wall_s'] * 1e6:.0f} | {r['bytes'] / r['wall_s'] / 1e9:.0f} | "
                f"{wall_ratio:.2f}x | {r['device_s'] * 1e6:.0f} | {r['bytes'] / r['device_s'] / 1e9:.0f} | "
                f"{device_ratio:.2f}x | {r['host_s'] * 1e6:.0f} | {verdict} |"
            )
    payload = {
        "figures": figures,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    write_results("pack_gpu", payload, lines)
