"""The NIXL backend for the transport contract's checks (tests/test_transport_nixl.py):
on this host (``make_nixl``), or with the two ends on two network-namespace hosts
(``OnTwoHosts``)."""

from __future__ import annotations

import os

from support import cluster as testcluster

__all__ = ["OnTwoHosts", "make_nixl"]


def make_nixl(token: bytes, **options):
    """A NIXL transport (its UCX plugin; host memory without a GPU)."""
    from replica.transport.nixl import NixlConfig, NixlTransport

    return NixlTransport(NixlConfig(token=token, **options))


class OnTwoHosts:
    """``make`` for a contract check run across two network-namespace hosts, each given as
    (netns, address): the process that runs the check (``home``) builds its transport on
    ``here``; every other process (the peers the check spawns) moves to ``there`` first."""

    def __init__(self, home: int, here: tuple[str, str], there: tuple[str, str]):
        self.home, self.here, self.there = home, here, there

    def __call__(self, token: bytes, **options):
        netns, address = self.here if os.getpid() == self.home else self.there
        testcluster.enter(netns)
        return make_nixl(token, host=address, **options)
