"""Read a job's state for bench/ettr.py from a test-cluster host, where the job
store can be reached: for each line read from stdin, one JSON line out.

    store_probe.py ADDRESS TIMEOUT_S        (REPLICA_TOKEN in the environment)

``members``: the membership table (role, rank, host, pid, state, ...);
``commit``: the last global commit's step (null before the first);
``losses N``: {step: {"losses": [hex per rank], "metrics": [per rank], "at":
rank 0's time}} of steps 1..N that every rank logged. Values are
read through the signed job store view: a forged entry reads as absent."""

import json
import os
import sys
from datetime import timedelta

from replica import envvars
from replica.jobstore import JobStore, keys
from replica.jobstore.stores import StoreAddress


def logged(store: JobStore, steps: int, world_size: int = 2) -> dict:
    texts = {r: store.get_many([keys.loss(r, s) for s in range(1, steps + 1)]) for r in range(world_size)}
    out = {}
    for i in range(steps):
        parts = [texts[r][i].value.split(" ") if texts[r][i] is not None else None for r in range(world_size)]
        if all(parts):
            out[i + 1] = {
                "losses": [p[0] for p in parts],
                "metrics": [dict(x.split("=", 1) for x in p[2:]) for p in parts],
                "at": float(parts[0][1]),
            }
    return out


def main() -> None:
    address, timeout_s = StoreAddress.parse(sys.argv[1]), float(sys.argv[2])
    store = JobStore(address.connect(timeout=timedelta(seconds=timeout_s)), token=os.environ[envvars.TOKEN].encode())
    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        query = line.strip()
        if query == "members":
            table = store.get(keys.members())
            answer = json.loads(table.value) if table is not None else []
        elif query == "commit":
            commit = store.get(keys.commit())
            answer = commit.step if commit is not None else None
        elif query.startswith("losses "):
            answer = logged(store, int(query.split()[1]))
        else:
            answer = {"error": f"unknown query {query!r}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
