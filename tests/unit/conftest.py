import os

import pytest


@pytest.fixture(scope="module")
def ray_session():
    """A private local Ray (2 CPUs) for the tests of one module that start train groups."""
    import ray

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()
