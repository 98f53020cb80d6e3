"""The weight sync's transfer alone, without vLLM: ``replica.WeightSync`` pushes a
model of fp32 linear layers from this process to a ``WeightReceiver`` in another,
with digests and without them, in alternate rounds, beside raw UCX without digests
of the same bytes in the sync's bucket size between the same two processes (a
round before each pair of pushes, a pause before each). A push is timed from its
start until the receiving process has the version complete and verified (its
``wait_ready``). Beside them, in this process: the sender's pack of the model with
digests alone (a push to no engine) and the receiver's checksum of the same bytes
alone, the work a push with digests does that raw UCX does not. Each transfer's CPU
time (both processes, every thread: UCX's progress threads too) gives how busy it kept
the cores, and the floor the cores put under a push with digests: raw UCX's CPU time
plus that work, spread over every core, where nothing idles.

usage: weight_push_run.py MIB ROUNDS OUT.json [BACKENDS]

BACKENDS (default "ucx,gloo"): the transports of both ends, in order of preference.
Prints the medians and ratios; writes them, and every round's seconds, to OUT.json."""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from bench_results import cores_busy, cores_floor, usable_cores

import replica
from replica import ops
from replica.session.backends import check_backends
from replica.weights import WeightReceiver

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' helpers (support)
from support.children import spawn
from support.cpu import cpu_since
from support.transfer import RawUcx

TOKEN = b"bench-weight-push-token"
TIMEOUT = timedelta(seconds=300)
LAYER = 2048  # a layer is LAYER x LAYER fp32: 16 MiB
WARMUP = 2  # rounds: allocator, page faults, connections
PAUSE_S = 0.3  # before each transfer: the cores settle, as between an RL loop's steps
MODES = {"plain": False, "verified": True}  # Config.verify of both ends


def _configs(backends: tuple[str, ...]) -> dict[str, replica.Config]:
    """One sync per mode, each in a store namespace of its own (its engine 0)."""
    base = replica.Config(token=TOKEN, timeout=TIMEOUT, backends=backends)
    return {
        name: dataclasses.replace(base, verify=verify, store_prefix=f"push-{name}") for name, verify in MODES.items()
    }


def _engine(pipe, port: int, backends: tuple[str, ...]) -> None:
    """The receiving process: a WeightReceiver per mode, and the raw UCX baseline's receiving end."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    receivers = {
        name: WeightReceiver(index=0, store=store, config=config) for name, config in _configs(backends).items()
    }
    with RawUcx(token=TOKEN, timeout=TIMEOUT) as raw:
        pipe.send(("ready", raw.listen()))
        buf = None
        while (cmd := pipe.recv())[0] != "exit":
            if cmd[0] == "raw":  # ("raw", nbytes, bucket_bytes)
                buf = buf if buf is not None else torch.empty(cmd[1], dtype=torch.uint8)
                raw.receive(buf, cmd[2])
                pipe.send(("received",))
            else:  # ("ready", mode, step): once that version is complete and verified
                receiver = receivers[cmd[1]]
                assert receiver.wait_ready(cmd[2], TIMEOUT), f"{cmd[1]} step {cmd[2]} never arrived"
                assert receiver.apply(lambda views: None) == cmd[2]
                pipe.send(("ready",))
    for receiver in receivers.values():
        receiver.close()
    pipe.send(("closed",))


def main(mib: int, rounds: int, out: Path, backends: tuple[str, ...] = ("ucx", "gloo")) -> None:
    torch.set_num_threads(1)
    # NIXL's agent before the raw baseline's ucxx: a process that loads ucxx's UCX first slows
    # NIXL's (replica.transport.nixl_agent). The engine's process makes its receivers first.
    check_backends(backends)
    layers = max(1, mib // 16)
    model = torch.nn.Sequential(*[torch.nn.Linear(LAYER, LAYER, bias=False) for _ in range(layers)])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    configs = _configs(backends)
    seconds: dict[str, list[float]] = {"raw_ucx": [], **{name: [] for name in MODES}}
    cpu: dict[str, list[float]] = {name: [] for name in seconds}  # core-seconds of both processes
    with spawn(_engine, store.port, backends, name="engine") as engine, RawUcx(token=TOKEN, timeout=TIMEOUT) as raw:
        _, address = engine.recv(timeout=120)
        syncs = {
            name: replica.WeightSync(model, store=store, num_engines=1, config=config)
            for name, config in configs.items()
        }
        layout = syncs["verified"].layout
        nbytes, bucket = layout.total_bytes, layout.bucket_bytes
        src = torch.ones(nbytes, dtype=torch.uint8)
        for step in range(1, WARMUP + rounds + 1):
            time.sleep(PAUSE_S)
            used = cpu_since(engine.pid)
            engine.send("raw", nbytes, bucket)
            raw_s = raw.send(address, src, bucket)
            assert engine.recv(timeout=300) == ("received",)
            timed, spent = {"raw_ucx": raw_s}, {"raw_ucx": used()}
            for name in list(MODES)[:: 1 if step % 2 else -1]:  # each mode first as often as second
                time.sleep(PAUSE_S)
                used = cpu_since(engine.pid)
                start = time.perf_counter()
                stats = syncs[name].push(step)
                engine.send("ready", name, step)
                assert engine.recv(timeout=300) == ("ready",)
                timed[name] = time.perf_counter() - start
                spent[name] = used()
                assert stats.engines_synced == [0], stats.engines_skipped
            if step > WARMUP:
                for name, value in timed.items():
                    seconds[name].append(value)
                    cpu[name].append(spent[name])
        for sync in syncs.values():
            sync.close()
        engine.send("exit")
        assert engine.recv(timeout=120) == ("closed",)
    # The work a push with digests does beyond raw UCX, each alone on this process's core: the
    # pack is a push to no engine (the same gathers and pack with digests, nothing sent).
    alone = replica.WeightSync(
        model, store=store, num_engines=0, config=dataclasses.replace(configs["verified"], store_prefix="push-alone")
    )
    pack_s, checksum_s = [], []
    for step in range(rounds + 1):
        start = time.perf_counter()
        alone.push(step)
        pack_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        ops.checksum(src, bucket)
        checksum_s.append(time.perf_counter() - start)
    alone.close()
    med = {name: statistics.median(values) for name, values in seconds.items()}
    med_cpu = {name: statistics.median(values) for name, values in cpu.items()}
    busy = {name: cores_busy(cpu[name], seconds[name]) for name in seconds}
    pack_alone, checksum_alone = statistics.median(pack_s[1:]), statistics.median(checksum_s[1:])
    # A push with digests does raw UCX's work and the pack and the checksum besides.
    floor_s = cores_floor(med["raw_ucx"], med_cpu["raw_ucx"], pack_alone + checksum_alone)
    result = {
        "bytes": nbytes,
        "rounds": rounds,
        "bucket_bytes": bucket,
        "backends": list(backends),
        "raw_ucx_s": med["raw_ucx"],
        "plain_s": med["plain"],
        "verified_s": med["verified"],
        "plain_vs_raw_ucx": med["raw_ucx"] / med["plain"],
        "verified_vs_raw_ucx": med["raw_ucx"] / med["verified"],
        "verified_vs_plain": med["plain"] / med["verified"],
        "pack_checksum_s": pack_alone,
        "checksum_s": checksum_alone,
        "cores": usable_cores(),
        "cpu_s": med_cpu,
        "cores_busy": busy,
        "verified_floor_s": floor_s,
        "verified_floor_vs_raw_ucx": med["raw_ucx"] / floor_s,
        "all": seconds,
        "all_cpu": cpu,
    }
    print(
        f"{nbytes / 2**20:.0f} MiB over {','.join(backends)}, {rounds} rounds: raw UCX {med['raw_ucx'] * 1e3:.0f} ms,"
        f" push without digests {med['plain'] * 1e3:.0f} ms ({result['plain_vs_raw_ucx']:.2f}x raw),"
        f" with digests {med['verified'] * 1e3:.0f} ms ({result['verified_vs_raw_ucx']:.2f}x raw,"
        f" {result['verified_vs_plain']:.2f}x without); alone: the pack with digests"
        f" {result['pack_checksum_s'] * 1e3:.0f} ms, the checksum {result['checksum_s'] * 1e3:.0f} ms;"
        f" CPU time (cores busy) raw {med_cpu['raw_ucx'] * 1e3:.0f} ms ({busy['raw_ucx']:.0%}), without digests"
        f" {med_cpu['plain'] * 1e3:.0f} ms ({busy['plain']:.0%}), with {med_cpu['verified'] * 1e3:.0f} ms"
        f" ({busy['verified']:.0%}) on {result['cores']} cores; the cores' floor under a push with digests"
        f" {floor_s * 1e3:.0f} ms ({result['verified_floor_vs_raw_ucx']:.2f}x raw)"
    )
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main(
        int(sys.argv[1]),
        int(sys.argv[2]),
        Path(sys.argv[3]),
        *([tuple(sys.argv[4].split(","))] if len(sys.argv) > 4 else []),
    )
