"""One role of a job as a Ray actor. The actor runs the user's script as a child process,
exactly as ``replica launch`` and ``replica agent`` do (``python SCRIPT`` with the role's
environment), so a role behaves the same under every launcher; the child is SIGKILLed
when its actor's process dies (``ray.kill``, a killed worker, a lost node), so Ray's view
of the actor and the role's own life agree."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import ray

from replica import envvars
from replica.errors import MainThreadError
from replica.roles.local_agent import die_with_launcher

__all__ = ["RoleProcess", "node_domain", "node_host_name", "unnice"]

logger = logging.getLogger(__name__)


def unnice() -> int:
    """Give this thread (and the processes it starts) the priority of the raylet that
    started it; returns the niceness it runs at now. Ray starts its workers at niceness 15
    (``worker_niceness``) so that idle ones yield; a role is a trainer or a standby, which
    must not yield to every other process of a loaded machine: measured here with two busy
    processes per core, a job whose roles ran at 15 had not finished its first step after
    3.5 minutes (the same job at 0: seconds). Raising a priority needs root or
    CAP_SYS_NICE; without it the roles stay at Ray's niceness, with a warning."""
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        wanted = os.getpriority(os.PRIO_PROCESS, os.getppid())
    except OSError:
        wanted = 0
    if mine <= wanted:
        return mine
    try:
        os.setpriority(os.PRIO_PROCESS, 0, wanted)  # Linux: this thread; the role's process inherits it
    except PermissionError:
        logger.warning(
            "this role runs at Ray's worker niceness %d (raising it needs CAP_SYS_NICE): on a loaded "
            "machine start Ray with RAY_worker_niceness=0 in the environment of `ray start`",
            mine,
        )
        return mine
    return wanted


def node_host_name(node_id: str) -> str:
    """The host name a role on Ray node ``node_id`` joins the job with (REPLICA_HOST_NAME):
    the node, not the machine's hostname, which simulated nodes share."""
    return f"ray-{node_id[:12]}"


def node_domain(node_id: str, labels: dict[str, str], label: str | None) -> str:
    """The failure domain of Ray node ``node_id`` whose labels are ``labels``: with ``label``
    (``Placement.domain_label``, say ``"rack"``), ``"rack=<value>"`` where the node has that
    label (``ray start --labels '{"rack": "r7"}'``), else the node alone, as without one."""
    value = labels.get(label) if label else None
    return f"{label}={value}" if value else node_host_name(node_id)


def _flat(labels: dict) -> dict[str, str]:
    """Ray's node labels as str -> str (some Ray versions give a list of values per key)."""
    return {str(k): str(v[0] if isinstance(v, list | tuple) and v else v) for k, v in labels.items()}


class RoleProcess:
    """The body of a role actor (``ray.remote(RoleProcess)``); its methods run one at a
    time on the worker's main thread, which started the child (PR_SET_PDEATHSIG is tied
    to the thread that forked)."""

    def __init__(self, argv: list[str], env: dict[str, str], domain_label: str | None = None):
        if threading.current_thread() is not threading.main_thread():
            raise MainThreadError("a role actor must run its methods on the main thread (max_concurrency=1)")
        context = ray.get_runtime_context()
        self.node = context.get_node_id()
        env = {**os.environ, **env, envvars.HOST_NAME: node_host_name(self.node)}
        if domain_label:  # the role's failure domain is its node's label (the coordinator keeps standbys out of it)
            env[envvars.DOMAIN] = node_domain(self.node, _flat(context.get_node_labels()), domain_label)
        # The address its listeners bind: the node's, unless the job pinned one.
        env.setdefault(envvars.HOST, ray.util.get_node_ip_address())
        unnice()
        self.popen = subprocess.Popen(die_with_launcher([sys.executable, *argv]), env=env)

    def where(self) -> tuple[int, str]:
        """(the role process's pid, this node's id)."""
        return self.popen.pid, self.node

    def wait(self, seconds: float) -> int | None:
        """The role's exit code once it exited, or None after ``seconds``."""
        try:
            return self.popen.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, seconds: float) -> int:
        """Let the role end by itself within ``seconds`` (a standby sees the job's end), then kill it."""
        code = self.wait(seconds)
        if code is None:
            self.popen.kill()
            code = self.popen.wait()
        return code
