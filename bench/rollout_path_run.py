"""One run of the rollout data path at a real RL step's size (``test_rollout_path.py`` runs it
in a process of its own): a driver's requests (``request_rollouts``) of PROMPTS x SAMPLES
prompts through ENGINES stand-in engines, each in a process of its own on the real serving
loop, desks and TCPStore. The engines are stand-ins (``support.rollouts``: no model):
each makes its completions from prompt and seed and takes tokens / RATE seconds for them, so
what a request takes beyond its generation is the data path's cost.

Measured, each a median over ROUNDS requests:
* ``step_s``: a request at RATE tokens/s per engine, against ``generation_s`` (its shards'
  tokens at that rate, the slowest engine's): the path's share of a step's rollout time;
* ``path_s``: a request with engines that take no time (what remains: the path, and the
  stand-in's own making of the tokens, ``make_s``, reported apart);
* ``store_path_s``: the old path's data movement for the same request (the prompts and every
  shard's completions as JSON values through the same TCPStore, written and read once);
* ``loopback_s``: the physical limit here, the same bytes sent once over a loopback socket.
And the largest value any process wrote to the store (asserted <= 64 KiB)."""

from __future__ import annotations

import json
import multiprocessing
import socket
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from replica.jobstore import Flag, JobStore, Number, keys
from replica.roles.rollout_data import encode_tokens
from replica.roles.rollout_engine import serve_requests
from replica.roles.rollouts import Sampling, request_rollouts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' helpers (support)
from support.rollouts import StandInEngine, largest_store_value, stand_in_completion

TOKEN = b"rollout-path-bench"
MAX_STORE_VALUE = 64 << 10


def _engine(port: int, index: int, engines: int, rate: float | None, report) -> None:
    store = JobStore(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60)), token=TOKEN)
    engine = StandInEngine(version=1, tokens_per_s=rate)
    with largest_store_value() as largest:
        serve_requests(
            store=store,
            index=index,
            num_engines=engines,
            token=TOKEN,
            engine=engine,
            stop=lambda: store.has(keys.rollout_stop(index)),
        )
    report.put((largest[0], engine.make_s))


def _round(store: JobStore, prompts, sampling, engines: int) -> float:
    start = time.perf_counter()
    got = request_rollouts(
        store, prompts, sampling, num_shards=engines, token=TOKEN, num_engines=engines, timeout=timedelta(minutes=10)
    )
    took = time.perf_counter() - start
    check = [0, len(prompts) // 2, len(prompts) - 1]
    assert all(
        got.completions[i] == stand_in_completion(prompts[i], sampling.seed + i, sampling.max_tokens) for i in check
    ), "wrong completions"
    return took


def _store_path(store: JobStore, prompts, completions, engines: int) -> float:
    """The old path's data movement: the request's prompts as one JSON value, each shard's
    completions as one, each written once and read once (raw TCPStore, no signing)."""
    raw = store.raw
    start = time.perf_counter()
    raw.set("old/req", json.dumps({"shards": [prompts[k::engines] for k in range(engines)]}))
    json.loads(raw.get("old/req"))
    for k in range(engines):
        raw.set(f"old/result/{k}", json.dumps({"completions": completions[k::engines]}))
    for k in range(engines):
        json.loads(raw.get(f"old/result/{k}"))
    return time.perf_counter() - start


def _loopback(nbytes: int) -> float:
    """``nbytes`` over a loopback TCP socket, once: the physical limit of the path here."""
    server = socket.create_server(("127.0.0.1", 0))
    payload = memoryview(bytearray(1 << 20))

    def sink() -> None:
        conn, _ = server.accept()
        buf, left = bytearray(1 << 20), nbytes
        while left:
            left -= conn.recv_into(buf, min(len(buf), left))
        conn.sendall(b"k")
        conn.close()

    reader = threading.Thread(target=sink)
    reader.start()
    client = socket.create_connection(server.getsockname())
    start = time.perf_counter()
    left = nbytes
    while left:
        client.sendall(payload[: min(len(payload), left)])
        left -= min(len(payload), left)
    client.recv(1)
    took = time.perf_counter() - start
    reader.join()
    client.close()
    server.close()
    return took


def main(
    prompts_n: int, samples: int, prompt_tokens: int, tokens: int, engines: int, rate: float, rounds: int, out: str
) -> None:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    store = JobStore(master, token=TOKEN)
    prompts = [[(p * 131 + j) % 32_000 for j in range(prompt_tokens)] for p in range(prompts_n) for _ in range(samples)]
    sampling = Sampling(max_tokens=tokens, seed=11)
    ctx = multiprocessing.get_context("fork")
    results: dict = {
        "prompts": prompts_n,
        "samples": samples,
        "prompt_tokens": prompt_tokens,
        "tokens": tokens,
        "engines": engines,
        "rate_tokens_per_s": rate,
        "rounds": rounds,
    }
    store.put(keys.latest_version(), Number(value=1))
    for mode, engine_rate in (("paced", rate), ("instant", None)):
        report = ctx.SimpleQueue()
        procs = [
            ctx.Process(target=_engine, args=(master.port, i, engines, engine_rate, report)) for i in range(engines)
        ]
        for proc in procs:
            proc.start()
        with largest_store_value() as largest:
            _round(store, prompts[: engines * 2], Sampling(max_tokens=2), engines)  # warm: connections, desks
            times = [_round(store, prompts, sampling, engines) for _ in range(rounds)]
        for i in range(engines):
            store.put(keys.rollout_stop(i), Flag())
        reports = [report.get() for _ in procs]
        for proc in procs:
            proc.join(60)
            assert proc.exitcode == 0, f"an engine process ended with {proc.exitcode}"
        for i in range(engines):
            store.delete(keys.rollout_stop(i))
        engine_largest = [r[0] for r in reports]
        make = [r[1] for r in reports]
        results[f"{mode}_all_s"] = times
        results[f"{mode}_largest_store_value"] = max([largest[0], *engine_largest])
        results[f"{mode}_make_s"] = max(make) / (rounds + 1)
    per_shard = [sum(tokens for _ in range(k, len(prompts), engines)) for k in range(engines)]
    results["generation_s"] = max(per_shard) / rate
    results["step_s"] = statistics.median(results["paced_all_s"])
    results["path_share"] = (results["step_s"] - results["generation_s"]) / results["generation_s"]
    results["path_s"] = statistics.median(results["instant_all_s"])
    results["make_s"] = results["instant_make_s"]
    completions = [stand_in_completion(p, sampling.seed + i, tokens) for i, p in enumerate(prompts)]
    results["store_path_s"] = statistics.median(
        _store_path(store, prompts, completions, engines) for _ in range(rounds)
    )
    prompt_bytes, completion_bytes = len(encode_tokens(prompts)), len(encode_tokens(completions))
    results["bytes"] = {"prompts": prompt_bytes, "completions": completion_bytes}
    results["loopback_s"] = _loopback(prompt_bytes * engines + completion_bytes)
    results["largest_store_value"] = max(results["paced_largest_store_value"], results["instant_largest_store_value"])
    assert results["largest_store_value"] <= MAX_STORE_VALUE, results["largest_store_value"]
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:6]), float(sys.argv[6]), int(sys.argv[7]), sys.argv[8])
