"""Pack, unpack and checksum throughput beside their baselines and the memcpy
limit, all measured in one run. `make bench` writes bench/results/pack.json
and bench/results/pack.md."""

from __future__ import annotations

import ctypes
import os
import platform
import random
from pathlib import Path

import pytest
import torch

from bench_results import write_results
from replica import ops

MiB = 1 << 20
LARGE_BYTES = 256 * MiB
LARGE_COUNT = 1000
SMALL_COUNT = 10_000
CHECKSUM_BLOCK = 1 * MiB
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]

# name -> (median seconds, payload bytes); filled by the benchmarks below.
_medians: dict[str, tuple[float, int]] = {}

TARGETS = {
    "pack_vs_memcpy": 0.9,
    "unpack_vs_memcpy": 0.9,
    "small_pack_vs_cat": 3.0,
    "small_pack_vs_memcpy": 0.5,
    "checksum_vs_memcpy": 0.5,
}


def _mixed_tensors(count: int, sizes: list[int], seed: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    tensors = []
    for nbytes in sizes[:count]:
        dtype = rng.choice(DTYPES)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        tensors.append(torch.randint(0, 100, (max(nbytes // itemsize, 1),)).to(dtype))
    return tensors


def _large_sizes(seed: int) -> list[int]:
    rng = random.Random(seed)
    weights = [rng.lognormvariate(0, 1.5) for _ in range(LARGE_COUNT)]
    scale = LARGE_BYTES / sum(weights)
    return [max(64, int(w * scale) // 64 * 64) for w in weights]


@pytest.fixture(scope="module")
def large():
    tensors = _mixed_tensors(LARGE_COUNT, _large_sizes(0), seed=0)
    offsets, total = ops.aligned_offsets(tensors)
    out = torch.zeros(total, dtype=torch.uint8)
    flat = torch.randint(0, 256, (total,), dtype=torch.uint8)
    return tensors, offsets, out, flat


@pytest.fixture(scope="module")
def small():
    rng = random.Random(1)
    sizes = [rng.randint(256, 4096) for _ in range(SMALL_COUNT)]
    tensors = _mixed_tensors(SMALL_COUNT, sizes, seed=1)
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


# --- small: 10,000 tensors of 256 B to 4 KiB ---


def test_small_pack(benchmark, small):
    tensors, offsets, out, _, _, _, payload = small
    _run(benchmark, "small_pack", payload, lambda: ops.pack(tensors, out, offsets), 40)


def test_small_cat(benchmark, small):
    _, _, _, _, cat_out, views, payload = small
    _run(benchmark, "small_cat", payload, lambda: torch.cat(views, out=cat_out), 40)


def test_small_memcpy_copy(benchmark, small):
    _, _, _, flat, cat_out, _, payload = small
    _run(benchmark, "small_memcpy_copy_", payload, lambda: cat_out.copy_(flat), 40)


def test_small_memcpy_memmove(benchmark, small):
    _, _, _, flat, cat_out, _, payload = small
    _run(benchmark, "small_memcpy_memmove", payload, lambda: ctypes.memmove(cat_out.data_ptr(), flat.data_ptr(), payload), 40)


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
    needed = {"large_pack", "large_unpack", "checksum", "small_pack", "small_cat",
              "large_memcpy_copy_", "large_memcpy_memmove", "small_memcpy_copy_", "small_memcpy_memmove"}
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
    }
    rows = [
        ("pack, 1,000 mixed tensors, 256 MiB", "large_pack", f"memcpy limit ({large_how})", large_limit, "pack_vs_memcpy"),
        ("unpack, same", "large_unpack", f"memcpy limit ({large_how})", large_limit, "unpack_vs_memcpy"),
        ("pack, 10,000 small tensors, ~21 MiB", "small_pack", "torch.cat(out=)", _gbps("small_cat"), "small_pack_vs_cat"),
        ("pack, same", "small_pack", f"memcpy limit ({small_how})", small_limit, "small_pack_vs_memcpy"),
        ("checksum, 256 MiB in 1 MiB blocks", "checksum", f"memcpy limit ({large_how})", large_limit, "checksum_vs_memcpy"),
    ]
    lines = [
        "| case | replica GB/s | beside | its GB/s | ratio | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, ours, beside, base, key in rows:
        met = "yes" if ratios[key] >= TARGETS[key] else "**no**"
        lines.append(f"| {case} | {_gbps(ours):.2f} | {beside} | {base:.2f} | {ratios[key]:.2f}x | >= {TARGETS[key]}x | {met} |")
    machine = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "processor": _cpu_model(),
        "python": platform.python_version(),
    }
    payload = {
        **ratios,
        "targets": TARGETS,
        "gbps": {name: _gbps(name) for name in sorted(_medians)},
        "median_s": {name: s for name, (s, _) in sorted(_medians.items())},
        "machine": machine,
    }
    header = f"### pack / unpack / checksum (medians; torch {machine['torch']}, {machine['threads']} threads, {machine['processor']})\n"
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

_gpu_medians: dict[str, tuple[float, int]] = {}


@pytest.fixture(scope="module")
def large_cuda(large):
    tensors, offsets, out, flat = large
    return [t.cuda() for t in tensors], offsets, out.cuda(), flat.cuda()


def _run_cuda(benchmark, name: str, nbytes: int, fn) -> None:
    def synced():
        fn()
        torch.cuda.synchronize()

    benchmark.extra_info["bytes"] = nbytes
    benchmark.pedantic(synced, rounds=30, warmup_rounds=3, iterations=1)
    if not benchmark.disabled:
        _gpu_medians[name] = (benchmark.stats.stats.median, nbytes)


@pytest.mark.gpu
def test_gpu_pack(benchmark, large_cuda):
    tensors, offsets, out, _ = large_cuda
    _run_cuda(benchmark, "gpu_pack", _payload(tensors), lambda: ops.pack(tensors, out, offsets))


@pytest.mark.gpu
def test_gpu_unpack(benchmark, large_cuda):
    tensors, offsets, out, _ = large_cuda
    _run_cuda(benchmark, "gpu_unpack", _payload(tensors), lambda: ops.unpack(out, tensors, offsets))


@pytest.mark.gpu
def test_gpu_copy(benchmark, large_cuda):
    _, _, out, flat = large_cuda
    _run_cuda(benchmark, "gpu_copy_", flat.numel(), lambda: out.copy_(flat))


@pytest.mark.gpu
def test_gpu_checksum(benchmark, large_cuda):
    _, _, _, flat = large_cuda
    _run_cuda(benchmark, "gpu_checksum", flat.numel(), lambda: ops.checksum(flat, CHECKSUM_BLOCK))


@pytest.fixture(scope="module", autouse=True)
def report_gpu():
    yield
    if not {"gpu_pack", "gpu_unpack", "gpu_copy_", "gpu_checksum"} <= _gpu_medians.keys():
        return
    gbps = {name: n / s / 1e9 for name, (s, n) in _gpu_medians.items()}
    limit = gbps["gpu_copy_"]
    payload = {
        "gpu_pack_vs_copy": gbps["gpu_pack"] / limit,
        "gpu_unpack_vs_copy": gbps["gpu_unpack"] / limit,
        "gpu_checksum_vs_copy": gbps["gpu_checksum"] / limit,
        "gbps": gbps,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    lines = [
        f"### GPU ({payload['device']}), 1,000 mixed tensors, 256 MiB; beside one device-to-device copy_ ({limit:.0f} GB/s)\n",
        "| op | GB/s | vs copy_ |",
        "|---|---|---|",
    ]
    for op in ("pack", "unpack", "checksum"):
        lines.append(f"| {op} | {gbps['gpu_' + op]:.0f} | {payload[f'gpu_{op}_vs_copy']:.2f}x |")
    write_results("pack_gpu", payload, lines)
