"""Watch the job store from a test-cluster host, where it can be reached
(tests/test_hosts.py): for each key read from stdin, print "ok KEY" once it is
in the store, or "timeout KEY" after TIMEOUT_S.

    wait_key.py ADDRESS TIMEOUT_S

ADDRESS as REPLICA_STORE takes it (HOST:PORT, or etcd://... with the etcd
credentials in the environment)."""

import sys
import time
from datetime import timedelta

from replica.jobstore.stores import StoreAddress
from replica.timing import Deadline


def main() -> None:
    address, timeout_s = StoreAddress.parse(sys.argv[1]), float(sys.argv[2])
    store = address.connect(timeout=timedelta(seconds=timeout_s))
    print("ready", flush=True)
    for line in sys.stdin:
        key = line.strip()
        deadline = Deadline.after(timedelta(seconds=timeout_s))
        while not store.check([key]) and not deadline.expired:
            time.sleep(0.02)
        print("ok" if store.check([key]) else "timeout", key, flush=True)


if __name__ == "__main__":
    main()
