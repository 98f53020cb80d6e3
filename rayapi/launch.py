"""``replica launch --ray ADDRESS``: the same command and script, the roles as Ray actors."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import ray

from replica import envvars
from replica.ray.ray_agents import Placement, RayAgents
from replica.roles.env import Role

__all__ = ["parse_placement", "ray_agents", "role_env_for_ray"]

# What of the driver's environment the roles take to other nodes: the job's and its libraries'
# settings, not the driver machine's (paths, credentials of other tools).
_CARRIED = (envvars.PREFIX, "UCX_", "TORCH_", "NCCL_", "GLOO_", "OMP_NUM_THREADS", "PYTHONPATH", "HF_", "VLLM_")


def role_env_for_ray(env: dict[str, str]) -> dict[str, str]:
    """The part of a launched job's environment (``replica.roles.local_agent.role_env``) its Ray
    actors carry: every replica variable (``replica.roles.env.job_environ``'s among them) and
    its libraries' settings."""
    return {k: v for k, v in env.items() if k.startswith(_CARRIED)}


def parse_placement(text: str) -> Placement:
    """``--ray-placement``'s JSON (empty: the defaults); ValueError naming what is wrong."""
    if not text:
        return Placement()
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--ray-placement is not JSON: {exc}") from exc
    roles = tuple(map(str, Role))  # Placement's resource fields are named after the roles
    known = {*roles, "strategy", "timeout_s", "start_timeout_s", "domain_label"}
    if not isinstance(spec, dict) or set(spec) - known:
        raise ValueError(f"--ray-placement takes an object with keys {sorted(known)}, got {text!r}")
    kwargs: dict = {}
    for role in roles:
        if role in spec:
            resources = spec[role]
            if not isinstance(resources, dict) or not all(
                isinstance(v, int | float) and v >= 0 for v in resources.values()
            ):
                raise ValueError(f"--ray-placement: {role} takes resource amounts >= 0, got {resources!r}")
            kwargs[role] = {str(k): float(v) for k, v in resources.items()}
    if "strategy" in spec:
        if spec["strategy"] not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(
                f"--ray-placement: strategy is one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD, got "
                f"{spec['strategy']!r}"
            )
        kwargs["strategy"] = spec["strategy"]
    for key, field in (("timeout_s", "timeout"), ("start_timeout_s", "start_timeout")):
        if key in spec:
            if not isinstance(spec[key], int | float) or spec[key] <= 0:
                raise ValueError(f"--ray-placement: {key} must be > 0, got {spec[key]!r}")
            kwargs[field] = timedelta(seconds=spec[key])
    if "domain_label" in spec:
        if not isinstance(spec["domain_label"], str) or not spec["domain_label"]:
            raise ValueError(f"--ray-placement: domain_label names a Ray node label, got {spec['domain_label']!r}")
        kwargs["domain_label"] = spec["domain_label"]
    return Placement(**kwargs)


def ray_agents(
    *,
    address: str,
    placement: str | Placement,
    script: list[str],
    env: dict[str, str],
    replacements: int,
    trainers: int,
    rollouts: int,
    standbys: int,
    members: Callable[[], list[tuple[str, int, str, str]]],
    shared_domains: bool = False,
) -> RayAgents:
    """Connect to the Ray cluster at ``address`` and reserve the job's machines (PlacementError
    if it cannot within the placement's deadline). The script path is made absolute: every
    node must have it at that path (a shared folder, the image, or Ray's runtime_env)."""
    if not isinstance(placement, Placement):
        placement = parse_placement(placement)
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=True)
    script = [str(Path(script[0]).resolve()), *script[1:]]
    agents = RayAgents(
        script=script,
        env=role_env_for_ray(env),
        replacements=replacements,
        placement=placement,
        trainers=trainers,
        rollouts=rollouts,
        standbys=standbys,
        members=members,
        shared_domains=shared_domains,
    )
    agents.reserve()
    return agents
