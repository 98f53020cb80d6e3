"""One size of the weight-sync benchmark, in a process of its own (vLLM keeps
process-global state, so one engine per process): a running in-process vLLM
engine receives the weights of a Llama-style model

* pushed by ``replica.WeightSync`` from a trainer process (pack, UCX, digests),
  prepared beside the live model (vLLM's loaders and oneDNN repack, in a
  background thread) and switched to between generations (prefix-cache reset
  included): ``sync_s`` (push until the engine serves it), split into
  ``receive_s`` (until the version is complete in the engine's receiver),
  ``prepare_s`` and ``stall_s`` (the switch: the only time the engine cannot
  generate); with the engine idle, and again while it generates without pause
  (``busy_sync_s``, ``generations_during_sync`` beside ``generate_s``, one batch);
* reloaded by vLLM from the same weights in safetensors on disk
  (``reload_weights(weights_path=...)``, page cache warm): ``disk_reload_s``,
  and the trainer's save of that file: ``disk_save_s``;
* as bytes only: a gloo broadcast of the same bytes between two processes, raw
  UCX without digests in the sync's bucket size from the trainer's process to the
  engine's, a round before each idle push (after them when PAUSE_S is 0)
  (``raw_ucx_s``; ``raw_ucx_apart_s``:
  between two fresh processes after the engine is gone), and a memcpy of them
  (the physical limit here).

usage: weight_sync_run.py SIZE ROUNDS OUT.json [PAUSE_S [BACKENDS]]

PAUSE_S (default 0): seconds the idle rounds wait after a switch before the next push, as an
RL loop generates between versions. With 0 the push lands while the engine is still settling
the switch: with one receive buffer (the staged default) its pages went back to the OS as the
last version was prepared, and faulting them in again (``WeightReceiver.prefault`` on the
stager's thread, or the receive itself) is in ``receive_s``.

BACKENDS (default: Config's, which on one node push through shared memory: one copy, the
engine's digest taken by its copy): the transports of both ends, comma-separated, in order of
preference; "ucx,gloo" pushes over UCX.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import replica
from support.children import spawn
from support.ports import free_port
from support.transfer import RawUcx, make_ucx, transport_path
from support.vllm_engine import greedy, make_llm, make_model

SHAPES = {
    "tiny": dict(hidden=128, layers=2, intermediate=256),
    "256MiB": dict(hidden=768, layers=8, intermediate=3072),  # tests/test_vllm_transfer.py's memory bound
    "1GiB": dict(hidden=1024, layers=16, intermediate=4096),
}
TOKEN = b"bench-weights-token"
WARMUP = 3  # rounds: an engine syncs every step for hours, the steady state is what counts
CONFIG = replica.Config(token=TOKEN, timeout=timedelta(seconds=300))


def _sender(
    pipe, folder: str, port: int, token: bytes = TOKEN, change: bool = False, backends: tuple[str, ...] | None = None
) -> None:
    """The trainer: pushes the model's weights on each "push" (``change``: negated first, so
    every version differs, as training makes them)."""
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    config = dataclasses.replace(CONFIG, token=token, **({"backends": backends} if backends else {}))
    sync = replica.WeightSync(model, store=store, num_engines=1, config=config)
    pipe.send(("ready", sync.layout.total_bytes))
    raw, raw_buffer = None, None  # the raw UCX baseline's sending end, and its bytes
    while (cmd := pipe.recv())[0] in ("push", "raw"):
        if cmd[0] == "raw":  # one round of raw UCX to the engine's process: ("raw", address, nbytes, bucket)
            _, address, nbytes, bucket = cmd
            raw = raw or RawUcx(token=token, timeout=CONFIG.timeout)
            raw_buffer = raw_buffer if raw_buffer is not None else torch.ones(nbytes, dtype=torch.uint8)
            pipe.send(("raw", raw.send(address, raw_buffer, bucket)))
            continue
        if change:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-1.0)
        stats = sync.push(cmd[1])
        pipe.send(("pushed", stats.engines_synced))
    sync.close()
    if raw is not None:
        raw.close()
    with contextlib.suppress(OSError):  # a parent that does not wait for it may be gone
        pipe.send(("closed",))


def _gloo_peer(pipe, port: int, nbytes: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    while pipe.recv()[0] == "round":
        dist.broadcast(buf, src=0)
        pipe.send(("ok",))
    dist.destroy_process_group()


def main(size: str, rounds: int, out: Path, pause_s: float = 0.0, backends: tuple[str, ...] | None = None) -> None:
    with tempfile.TemporaryDirectory(prefix="replica-bench-weights-") as work:  # two models: ~2 GB for 1GiB
        run(size, rounds, out, Path(work), pause_s, backends)


def run(
    size: str, rounds: int, out: Path, work: Path, pause_s: float = 0.0, backends: tuple[str, ...] | None = None
) -> None:
    from replica.integrations.vllm.worker import EngineWeights, ReceiverSpec

    torch.manual_seed(0)
    make_model(work / "engine", 0, **SHAPES[size])
    make_model(work / "trained", 1, **SHAPES[size])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    llm = make_llm(work / "engine")
    weights = EngineWeights(
        llm,
        ReceiverSpec(index=0, store=f"127.0.0.1:{store.port}", token_hex=TOKEN.hex(), timeout_s=300, backends=backends),
    )
    sync_s, receive_s, prepare_s, stall_s, disk_s, save_s, gloo_s, memcpy_s = [], [], [], [], [], [], [], []
    generate_s, busy_s, during, ucx_s = [], [], [], []
    with (
        spawn(_sender, str(work / "trained"), store.port, TOKEN, False, backends, name="trainer") as trainer,
        RawUcx(token=TOKEN, timeout=CONFIG.timeout) as raw_ucx,
    ):
        _, nbytes = trainer.recv(timeout=300)
        # Raw UCX without digests between the same two processes, the same bytes in the sync's
        # bucket size, all in flight at once (the transfer's limit on UCX): with a pause, a round
        # before each push, a pause before each, so both find the engine settled; back to back
        # (no pause), a block of rounds after the pushes, which then land as before.
        raw_address, raw_buffer = raw_ucx.listen(), torch.empty(nbytes, dtype=torch.uint8)
        bucket = CONFIG.bucket_bytes_for("cpu")  # the CPU model's weight push

        def raw_round() -> float:
            trainer.send("raw", raw_address, nbytes, bucket)
            raw_ucx.receive(raw_buffer, bucket)
            return trainer.recv(timeout=300)[1]

        for step in range(1, rounds + WARMUP + 1):  # the first rounds warm up: allocator and page cache
            if pause_s > 0:
                time.sleep(pause_s)
                raw_s = raw_round()
                if step > WARMUP:
                    ucx_s.append(raw_s)
            time.sleep(pause_s)
            start = time.perf_counter()
            trainer.send("push", step)
            while (llm.collective_rpc("replica_ready")[0] or 0) < step:  # received and verified
                time.sleep(0.002)
            received = time.perf_counter()
            assert all(llm.collective_rpc("replica_wait", args=(step, 300.0)))  # prepared
            ready = time.perf_counter()
            assert weights.update() == step  # switched, prefix cache reset: serving it
            done = time.perf_counter()
            assert trainer.recv(timeout=300)[1] == [0]
            if step > WARMUP:
                sync_s.append(done - start)
                receive_s.append(received - start)
                prepare_s.append(ready - received)
                stall_s.append(done - ready)
        assert weights.staging == "staged", weights.staging
        if pause_s == 0:
            ucx_s = [raw_round() for _ in range(rounds + WARMUP)][WARMUP:]
        for i in range(rounds + 1):  # one batch, the engine's unit of work here
            start = time.perf_counter()
            greedy(llm)
            if i:
                generate_s.append(time.perf_counter() - start)
        first = rounds + WARMUP + 1
        for step in range(first, first + rounds):  # the engine generates without pause meanwhile
            start, batches = time.perf_counter(), 0
            trainer.send("push", step)
            while not llm.collective_rpc("replica_wait", args=(step, 0.0))[0]:
                greedy(llm)
                batches += 1
            assert weights.update() == step
            busy_s.append(time.perf_counter() - start)
            during.append(batches)
            assert trainer.recv(timeout=300)[1] == [0]
        trainer.send("exit")
        assert trainer.recv(timeout=300) == ("closed",)  # its side first: this side's then flushes cleanly
        raw_buffer = None  # its memory back before the export below (raw_round holds the name)
    from safetensors.torch import load_file, save_file

    state = load_file(str(work / "trained" / "model.safetensors"))
    for i in range(rounds + 1):
        start = time.perf_counter()
        save_file(state, str(work / "trained" / "model.safetensors"))
        saved = time.perf_counter() - start
        start = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(work / "trained")})
        llm.reset_prefix_cache()
        if i:
            save_s.append(saved)
            disk_s.append(time.perf_counter() - start)
    del llm, weights
    port = free_port()
    buf = torch.ones(nbytes, dtype=torch.uint8)
    with spawn(_gloo_peer, port, nbytes, name="gloo-peer") as peer:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
        for i in range(rounds + 1):
            start = time.perf_counter()
            peer.send("round")
            dist.broadcast(buf, src=0)
            peer.recv(timeout=300)
            if i:
                gloo_s.append(time.perf_counter() - start)
        peer.send("exit")
        dist.destroy_process_group()
    # The same raw UCX between two fresh processes once the engine is gone, as this measured
    # it before (its figure moved between runs more than the transfer's did).
    ucx_apart_s = []
    with transport_path("ucx_plain", functools.partial(make_ucx, "^cma,knem,xpmem", False), "cpu") as path:
        _, peer, one_round = path
        assert peer.request("size", nbytes) == ("ok",)
        peer.send("bucketed_rounds", rounds + 1, bucket)
        for i in range(rounds + 1):
            start = time.perf_counter()
            one_round.bucketed(buf, bucket)
            if i:
                ucx_apart_s.append(time.perf_counter() - start)
        assert peer.recv(timeout=300) == ("ok",)
    dst = torch.empty_like(buf)
    for i in range(rounds + 1):
        start = time.perf_counter()
        dst.copy_(buf)
        if i:
            memcpy_s.append(time.perf_counter() - start)
    med = statistics.median
    out.write_text(
        json.dumps(
            {
                "size": size,
                "bytes": nbytes,
                "rounds": rounds,
                "sync_s": med(sync_s),
                "receive_s": med(receive_s),
                "prepare_s": med(prepare_s),
                "stall_s": med(stall_s),
                "generate_s": med(generate_s),
                "busy_sync_s": med(busy_s),
                "generations_during_sync": med(during),
                "disk_reload_s": med(disk_s),
                "disk_save_s": med(save_s),
                "gloo_broadcast_s": med(gloo_s),
                "memcpy_s": med(memcpy_s),
                "raw_ucx_s": med(ucx_s),
                "raw_ucx_apart_s": med(ucx_apart_s),
                "warmup_rounds": WARMUP,
                "pause_s": pause_s,
                "backends": list(backends or CONFIG.backends),
                "all": {
                    "sync_s": sync_s,
                    "prepare_s": prepare_s,
                    "stall_s": stall_s,
                    "busy_sync_s": busy_s,
                    "generations_during_sync": during,
                    "disk_reload_s": disk_s,
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main(
        sys.argv[1],
        int(sys.argv[2]),
        Path(sys.argv[3]),
        float(sys.argv[4]) if len(sys.argv) > 4 else 0.0,
        tuple(sys.argv[5].split(",")) if len(sys.argv) > 5 else None,
    )
