"""Free TCP ports for test processes to meet on."""

from __future__ import annotations

import contextlib
import socket

__all__ = ["free_port", "free_ports"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for rendezvous of test processes)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports that were free a moment ago (all held at once while chosen)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
