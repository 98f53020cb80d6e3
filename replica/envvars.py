"""Every environment variable replica reads or writes, by name: the writer and the reader
both import the name from here, so neither spells it out (``tests/test_package.py`` finds
any ``"REPLICA_..."`` literal elsewhere). The variables are read when a job starts or a
value is needed, never at import.

Stdlib only, at the bottom of the package: any layer may import it. What a role reads,
and how the launchers write it, is ``replica.roles.env`` (``RoleEnv.from_environ``,
``job_environ``); the documented table is in README.md.
"""

from __future__ import annotations

__all__ = [
    "ALLOW_SHARED_DOMAIN",
    "ATTEMPT",
    "BACKENDS",
    "DOMAIN",
    "DURABLE",
    "DURABLE_EVERY",
    "DURABLE_INTERVAL",
    "ETCD_CA",
    "ETCD_CERT",
    "ETCD_KEY",
    "ETCD_PASSWORD",
    "ETCD_USER",
    "EXPORT_DIR",
    "GLOO_LAZY_INIT",
    "HOST",
    "HOST_NAME",
    "INJECT",
    "LOG",
    "MASTER_ADDR",
    "MIRROR_DEVICE",
    "NIXL_BACKEND",
    "NIXL_PARAMS",
    "PREFIX",
    "RANK",
    "RESUME",
    "ROLE",
    "ROLLOUTS",
    "SIMD",
    "SPARE",
    "STEPS",
    "STORE",
    "STORE_PORT",
    "STRICT",
    "TOKEN",
    "TORCH_RANK",
    "TORCH_WORLD_SIZE",
    "UCX_LOG_LEVEL",
    "WORLD_SIZE",
]

#: What every replica variable's name starts with (the Ray layer carries them all to its nodes).
PREFIX = "REPLICA_"

# --- the job: written by the launchers (roles.env.job_environ: `replica launch`, `replica agent`,
# --- replica.ray), or by hand for a torchrun-style job; read by the roles (RoleEnv.from_environ)

#: The job's secret token. Written by the user or `replica launch` (a fresh one); read by every role,
#: `replica coordinator`, `replica agent`, and Config/Replicator/Mirror built without a token.
TOKEN = "REPLICA_TOKEN"
#: trainer, standby or rollout. Written by the agents per process (roles.env.member_environ); read by RoleEnv.
ROLE = "REPLICA_ROLE"
#: The role's trainer rank (a rollout's engine index). Written with ROLE; read by RoleEnv (else TORCH_RANK).
RANK = "REPLICA_RANK"
#: The number of trainer ranks. Written by the launchers; read by RoleEnv (else TORCH_WORLD_SIZE).
WORLD_SIZE = "REPLICA_WORLD_SIZE"
#: The job store, HOST:PORT or etcd://HOSTS/JOB. Written by the launchers and `replica agent`; read by RoleEnv.
STORE = "REPLICA_STORE"
#: The store's port when STORE is unset (with MASTER_ADDR). Written by hand; read by RoleEnv.
STORE_PORT = "REPLICA_STORE_PORT"
#: Where a role's data-plane listeners bind. Written by `replica agent` (--address) and the Ray actors;
#: read by RoleEnv.
HOST = "REPLICA_HOST"
#: The name the job knows a role's machine by. Written by the Ray actors (the node's id); read by
#: roles.env.host_name.
HOST_NAME = "REPLICA_HOST_NAME"
#: A role's failure domain (a rack, a switch, a zone), which its standby must not share; default: its host.
DOMAIN = "REPLICA_DOMAIN"
#: "1": a job may place a standby in its trainer's failure domain (one-machine demos and tests).
ALLOW_SHARED_DOMAIN = "REPLICA_ALLOW_SHARED_DOMAIN"
#: Faults to inject (--inject). Written by the launchers; read by RoleEnv, `replica agent`, `replica coordinator`.
INJECT = "REPLICA_INJECT"
#: The job's step count (--steps), for the script (RoleEnv.steps). Written by the launchers; read by RoleEnv.
STEPS = "REPLICA_STEPS"
#: Rollout engines in the job (--rollouts). Written by the launchers; read by RoleEnv.
ROLLOUTS = "REPLICA_ROLLOUTS"
#: Where standbys hold their mirrors ("" or cpu; --mirror-device). Written by the launchers; read by RoleEnv.
MIRROR_DEVICE = "REPLICA_MIRROR_DEVICE"
#: The durable floor's folder (--durable; "": no floor), and its cadence: a version every N steps
#: (--durable-every) and at least every S seconds (--durable-interval). Written by the launchers;
#: read by RoleEnv (replica.mirror.floor.FloorConfig).
DURABLE = "REPLICA_DURABLE"
DURABLE_EVERY = "REPLICA_DURABLE_EVERY"
DURABLE_INTERVAL = "REPLICA_DURABLE_INTERVAL"
#: Where roles export their versions when the job cannot go on (--export-dir). Written by the launchers;
#: read by RoleEnv.
EXPORT_DIR = "REPLICA_EXPORT_DIR"
#: A spare standby's index (--spares): it waits bound to no rank until the launcher binds it to one
#: (unset: not a spare). Written by the launchers; read by RoleEnv.
SPARE = "REPLICA_SPARE"
#: An export folder the trainers start from (--resume). Written by the launchers; read by RoleEnv.
RESUME = "REPLICA_RESUME"
#: The job's attempt the role belongs to (0, or unset: the first; N: the job started again N times, from its
#: durable floor or its start, its state under its own prefix). Written by the launchers and the host agents;
#: read by RoleEnv.
ATTEMPT = "REPLICA_ATTEMPT"
#: The data plane's transports, comma-separated (--backends). Written by the launchers; read by RoleEnv.
BACKENDS = "REPLICA_BACKENDS"
#: The NIXL backend plugin the "nixl" transport uses (UCX by default; LIBFABRIC on AWS EFA). Written by
#: the user; read where a nixl transport is made (replica.session.backends.nixl_options).
NIXL_BACKEND = "REPLICA_NIXL_BACKEND"
#: That plugin's init parameters, name=value pairs separated by commas (UCX: ucx_error_handling_mode=none).
#: Written by the user; read with NIXL_BACKEND.
NIXL_PARAMS = "REPLICA_NIXL_PARAMS"
#: "1": a divergence after a failover ends the job (--strict). Written by the launchers; read by RoleEnv.
STRICT = "REPLICA_STRICT"

# --- settings of the user's: written by the user, read where named

#: The log level of every role and the coordinator. Read by roles.env.configure_logging.
LOG = "REPLICA_LOG"
#: The CPU checksum build (avx512, avx2, portable). Read by csrc/simd.cpp when replica._C first hashes.
SIMD = "REPLICA_SIMD"
#: The etcd user every process of the job authenticates as. Read by jobstore.etcd.EtcdConfig.from_environ.
ETCD_USER = "REPLICA_ETCD_USER"
#: That user's password. Read by EtcdConfig.from_environ.
ETCD_PASSWORD = "REPLICA_ETCD_PASSWORD"
#: The CA that signed etcd's certificates (https). Read by EtcdConfig.from_environ.
ETCD_CA = "REPLICA_ETCD_CA"
#: A client certificate for etcd. Read by EtcdConfig.from_environ.
ETCD_CERT = "REPLICA_ETCD_CERT"
#: Its key. Read by EtcdConfig.from_environ.
ETCD_KEY = "REPLICA_ETCD_KEY"

# --- other tools' variables replica reads or sets

#: torchrun's rank: RoleEnv's fallback for RANK.
TORCH_RANK = "RANK"
#: torchrun's world size: RoleEnv's fallback for WORLD_SIZE.
TORCH_WORLD_SIZE = "WORLD_SIZE"
#: torchrun's rendezvous host: with STORE_PORT, RoleEnv's fallback for STORE.
MASTER_ADDR = "MASTER_ADDR"
#: Lazy gloo connections; the launchers set "1" unless the user set it (roles.env.process_environ).
GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"
#: UCX's log level; the launchers set "fatal" unless the user set it (roles.env.process_environ).
UCX_LOG_LEVEL = "UCX_LOG_LEVEL"
