"""The helpers of the tests and benchmarks: nothing shipped imports them and the wheel
leaves them out. tests/ is on the path of every pytest run (pyproject.toml's
``pythonpath``, for tests/ and bench/ alike), so a test module imports
``support.<module>``; a test module is never imported as a library. A program the tests
start in a process of its own puts tests/ on its path (the benchmarks' ``*_run.py``
scripts, tests/jobs/) or is given it (``host_job.python_on``).

Processes and machines:
    children     Child, spawn: children forked from the preloaded server; wait_for,
                 process_state, descendants, role_of
    cpu          cpu_seconds, cpu_since, busy_cores (a loaded machine)
    ports        free_port, free_ports
    resource     TornDown, the base of the resources below
    cluster      NetnsCluster: hosts as network namespaces on one machine (root)
    etcd         EtcdCluster: a real etcd cluster, authentication on
Jobs:
    launch       `replica launch` of the demo job or the RL loop to its report; the
                 multi-node way (start_coordinator, role_env); ROOT, EXAMPLE, RL, STEPS
    host_job     a job across network-namespace hosts; python_on, reap
    mirror_roles trainer and standby roles in children, for the mirror's tests and
                 benchmarks
The mirror and weights:
    state        the demo job at world size 1, trained, mirrored and compared bit for
                 bit (job, mirrored, state_of, assert_state_equal); assert_safe_open_reads
    stores       CountingStore: a store client that counts its requests
    resilient    a one-member ResilientProcessGroup (make_group, allreduce)
    tensors      random tensors of every dtype and size for the kernels (random_mix, packed)
Transports:
    transport_contract  the checks every Transport backend passes
    nixl                the NIXL backend for those checks, on one host or two
    transfer            the raw bucketed baseline (RawUcx) and benchmark paths to a peer
Engines:
    rollouts       a stand-in rollout engine (completions from prompt and seed)
    vllm_engine    a tiny random Llama and an in-process vLLM engine on it
    weight_engine  a stand-in inference engine that receives weight versions

Fixtures are conftest.py's: tests/conftest.py's for the tests (etcd, the reference runs, a
TCPStore server, ...), the top-level one's for tests/ and bench/ alike (ray_cluster: a Ray
cluster of simulated nodes).

The demo job's model (examples/fsdp_job.py) is an example, not a helper: it ships with
the examples, and the tests that build that job in-process import ``fsdp_job``
(examples/ is on pytest's path too). Test jobs run as scripts live in tests/jobs/.
"""
