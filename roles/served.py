"""A job served to host agents (``replica agent --serve``): ``replica coordinator ... SCRIPT``
names the script and the roles' settings in its job store (``keys.served_job``, signed as every
record is) and places every role of the job on the agents (``first_placement``, then
``roles/attempts.place``); each agent checks what it is given before it runs anything."""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path

from replica import envvars
from replica.jobstore import JobStore, ServedJob, keys
from replica.roles.env import Role

__all__ = ["first_placement", "serve_job", "served_job_refusal"]

#: What each agent sets for its roles itself (the store as it reaches it, its host's address, the
#: job's secret from its own environment): never taken from a served job.
_AGENTS_OWN = frozenset({envvars.STORE, envvars.HOST, envvars.TOKEN, envvars.DOMAIN})


def serve_job(store: JobStore, *, script: Path, args: Sequence[str], environ: Mapping[str, str]) -> ServedJob:
    """Name the job in ``store`` (at the job's own prefix) for the agents: ``script`` (a path that
    holds on every host) with ``args``, its roles' settings ``environ`` (``job_environ``'s; what each
    agent sets itself is left out). A new id: an agent serves each job once."""
    job = ServedJob(
        id=secrets.token_hex(8),
        script=str(script.resolve()),
        args=tuple(args),
        environ={name: value for name, value in environ.items() if name not in _AGENTS_OWN},
    )
    store.put(keys.served_job(), job)
    return job


def served_job_refusal(job: ServedJob) -> str:
    """Why this host cannot run ``job`` ("" when it can)."""
    path = Path(job.script)
    if not path.is_absolute() or not path.is_file():
        return f"its script {job.script} is not on this host (every host needs it at the same path)"
    odd = sorted(
        name
        for name, value in job.environ.items()
        if not name.startswith(envvars.PREFIX) or name in _AGENTS_OWN or not isinstance(value, str)
    )
    if odd:
        return f"it sets {', '.join(odd)}, which a job's settings do not hold"
    return ""


def first_placement(*, world_size: int, standbys: int, rollouts: int) -> dict[tuple[Role, int], str]:
    """Every role of a served job, none placed yet (``roles/attempts.place`` places them all)."""
    roles = [(Role.TRAINER, r) for r in range(world_size)] + [(Role.STANDBY, r) for r in range(standbys)]
    return dict.fromkeys(roles + [(Role.ROLLOUT, i) for i in range(rollouts)], "")
