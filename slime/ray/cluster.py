"""Connect to Ray: attach to a running cluster when one is given, else start a private local one
that listens on loopback only, with Ray's token authentication on.

Ray decides whether a local instance binds loopback or every interface from
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`, read once when `ray` is imported. A local run must not depend
on who imported `ray` first (the driver, a user's script, pytest), so `init` sets the variable for
every process Ray starts and the value Ray already read in this one (docs/security.md).
"""

from __future__ import annotations

import logging
import os

import ray
from ray._private import ray_constants  # the one place Ray keeps the loopback decision it read at import

from slime.engines.auth import API_KEY_ENV
from slime.utils.errors import SlimeError

logger = logging.getLogger(__name__)

LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

# What every slime process needs in its environment (Ray workers inherit these).
WORKER_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


def init(args=None) -> None:
    """`RAY_ADDRESS` set (e.g. under `ray job submit`): attach to that cluster. Otherwise a private
    local instance bound to loopback, sized to this machine's cores. Every process of the run gets
    the run's engine key (`args.engine_api_key`) in its environment (slime.engines.auth)."""
    if ray.is_initialized():
        return
    local = not os.environ.get("RAY_ADDRESS")
    wanted = dict(WORKER_ENV, **LOOPBACK_ONLY) if local else WORKER_ENV
    os.environ.update({k: v for k, v in wanted.items() if k not in os.environ})
    env = {k: os.environ[k] for k in wanted}  # a value the job or the user set wins
    if args is not None:
        os.environ[API_KEY_ENV] = env[API_KEY_ENV] = args.engine_api_key
    if not local:
        # Under `ray job submit` the job's runtime env (working dir, env vars) is already the
        # default for every worker; combine it with ours instead of refusing the overlap.
        os.environ.setdefault("RAY_OVERRIDE_JOB_RUNTIME_ENV", "1")
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env={"env_vars": env}, log_to_driver=True)
        return
    _bind_loopback()
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        logger.warning("RAY_AUTH_MODE=disabled: this run's Ray accepts unauthenticated requests from "
                       "local processes (docs/security.md)")
    ray.init(
        address="local",
        num_cpus=os.cpu_count() or 1,
        include_dashboard=False,
        runtime_env={"env_vars": env},
        log_to_driver=True,
    )


def _bind_loopback() -> None:
    """Make the local Ray instance bind loopback even when `ray` was imported before the variable
    was set (the child processes read the environment; this process already read the constant)."""
    if os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] not in ("0", "false", "False"):
        return  # the user asked Ray for a reachable local instance
    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        raise SlimeError(f"ray {ray.__version__}: cannot keep the local Ray instance on loopback (this Ray "
                         "has no ray_constants.ENABLE_RAY_CLUSTER); use the Ray version pyproject.toml names")
    ray_constants.ENABLE_RAY_CLUSTER = False
