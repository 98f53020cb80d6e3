"""How replica's processes end: their exit codes (a role's, which the agents and the launcher
read: ``replica.roles.supervise``, ``replica.roles.host_agent``; and the commands' own), and
the one way to end at once."""

from __future__ import annotations

import enum
import logging
import os
from typing import NoReturn

__all__ = ["ExitCode", "exit_now"]


class ExitCode(enum.IntEnum):
    OK = 0
    #: A command whose job failed or did not finish in time (``replica launch``, ``replica coordinator``).
    FAILED = 1
    #: A command refused before anything started: a bad command line or setting (argparse's status too).
    USAGE = 2
    #: A coordinator that lost its leadership (another one leads the job now).
    DEPOSED = 3
    #: A trainer that found itself replaced (fenced): another holds its rank now.
    FENCED = 75
    #: A role (or agent) whose job store went away: the coordinator died with no successor.
    COORDINATOR_LOST = 76
    #: A role whose redone step diverged from what it computed before the failure, under --strict.
    DIVERGED = 77
    #: ``supervise``'s, never a process's: the job failed before its first global commit and may
    #: start again from its start (``replica launch`` does, ``JobSpec.restarts_left`` times).
    RESTART = 78
    #: ``supervise``'s, never a process's: a rank lost every in-memory copy of its state and the job
    #: has a durable floor: it starts again from the floor's newest complete version (``replica launch``
    #: does, as ``--resume`` from it).
    RESUME = 79


def exit_now(code: ExitCode) -> NoReturn:
    """End the process at once (whatever thread this is, and whatever the others do), with
    what was logged written out first."""
    logging.shutdown()
    os._exit(int(code))
