"""Connect to Ray: attach to a running cluster when one is given, else start a private local one."""

from __future__ import annotations

import os

import ray

# What every slime process needs in its environment (Ray workers inherit these).
WORKER_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


def init() -> None:
    """`RAY_ADDRESS` set (e.g. under `ray job submit`): attach to that cluster. Otherwise a private
    local instance bound to loopback, sized to this machine's cores."""
    if ray.is_initialized():
        return
    os.environ.update({k: v for k, v in WORKER_ENV.items() if k not in os.environ})
    env = {k: os.environ[k] for k in WORKER_ENV}  # a value the job or the user set wins
    if os.environ.get("RAY_ADDRESS"):
        # Under `ray job submit` the job's runtime env (working dir, env vars) is already the
        # default for every worker; combine it with ours instead of refusing the overlap.
        os.environ.setdefault("RAY_OVERRIDE_JOB_RUNTIME_ENV", "1")
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env={"env_vars": env}, log_to_driver=True)
    else:
        ray.init(
            address="local",
            num_cpus=os.cpu_count() or 1,
            include_dashboard=False,
            runtime_env={"env_vars": env},
            log_to_driver=True,
        )
