"""Start a role ahead of time and hold it: import what its script needs (torch,
the library), wait for a line on stdin, then run SCRIPT as ``__main__``.

    held_role.py SCRIPT [ARGS...]

A test starts a replacement this way before the moment it is needed, so that
how long a loaded machine takes to import torch does not race a fixed stall of
the job (tests/test_hosts.py)."""

import runpy
import sys

import torch
import torch.distributed  # noqa: F401

import replica.roles  # noqa: F401

if __name__ == "__main__":
    print("held", flush=True)
    sys.stdin.readline()
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[0]).resolve().parent))
    runpy.run_path(sys.argv[0], run_name="__main__")
