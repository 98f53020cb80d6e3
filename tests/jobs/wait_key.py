"""Watch the job store from a test-cluster host, where it can be reached
(tests/test_hosts.py): for each key read from stdin, print "ok KEY" once it is
in the store, or "timeout KEY" after TIMEOUT_S.

    wait_key.py HOST PORT TIMEOUT_S"""

import sys
import time
from datetime import timedelta

import torch.distributed as dist


def main() -> None:
    host, port, timeout_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    print("ready", flush=True)
    for line in sys.stdin:
        key = line.strip()
        deadline = time.monotonic() + timeout_s
        while not store.check([key]) and time.monotonic() < deadline:
            time.sleep(0.02)
        print("ok" if store.check([key]) else "timeout", key, flush=True)


if __name__ == "__main__":
    main()
