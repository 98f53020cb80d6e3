"""replica on Ray (``pip install replica[ray]``): the job's roles as Ray actors placed with a
placement group (standby r on rollout r's node), Ray's actor and node deaths as detection
signals beside the job's own, replacements scheduled by Ray on healthy nodes.

From an RL driver::

    from replica.ray import RayJob, RayJobConfig

    with RayJob(RayJobConfig(script=["train.py"], trainers=2, rollouts=2, steps=100)) as job:
        job.start()                    # places and starts every role
        while not job.done():          # the trainers train and push weights to the engines
            batch = job.generate(prompts, Sampling(max_tokens=64))   # rollouts of the driver's own
            print(job.commit(), job.weights_version(), batch.versions, job.failovers())
        status = job.wait()            # 0 once every trainer finished

From the command line: ``replica launch --ray auto [options] SCRIPT``."""

from __future__ import annotations

try:
    import ray  # noqa: F401 - the extra must be installed before anything below imports it
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("replica.ray needs Ray: pip install 'replica[ray]'") from exc

from replica.ray.job import RayJob, RayJobConfig
from replica.ray.launch import ray_agents, role_env_for_ray
from replica.ray.ray_agents import Placement, RayAgents
from replica.roles.rollouts import Rollouts, Sampling

__all__ = ["Placement", "RayAgents", "RayJob", "RayJobConfig", "Rollouts", "Sampling", "ray_agents", "role_env_for_ray"]
