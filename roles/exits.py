"""How a role's process ends: its exit codes, which the agents and the launcher read
(``replica.roles.supervise``, ``replica.roles.host_agent``), and the one way to end at once."""

from __future__ import annotations

import enum
import logging
import os
from typing import NoReturn

__all__ = ["ExitCode", "exit_now"]


class ExitCode(enum.IntEnum):
    OK = 0
    #: A trainer that found itself replaced (fenced): another holds its rank now.
    FENCED = 75
    #: A role (or agent) whose job store went away: the coordinator died with no successor.
    COORDINATOR_LOST = 76
    #: A role whose redone step diverged from what it computed before the failure, under --strict.
    DIVERGED = 77


def exit_now(code: ExitCode) -> NoReturn:
    """End the process at once (whatever thread this is, and whatever the others do), with
    what was logged written out first."""
    logging.shutdown()
    os._exit(int(code))
