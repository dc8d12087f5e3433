import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The engine key of the servers tests start by hand (a run makes its own: --engine-api-key); slime's
# clients send the one in this variable, so tests talk to their servers as a run's parts do.
TEST_ENGINE_KEY = "slime-test-engine-key-0123456789"
os.environ.setdefault("SLIME_ENGINE_API_KEY", TEST_ENGINE_KEY)

from pathlib import Path

import pytest

E2E = Path(__file__).parent / "e2e"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """Everything under tests/e2e/ is an end-to-end run (marker `e2e`, excluded from the default run)."""
    for item in items:
        if E2E in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama model + locally trained tokenizer (HF directory), shared by every test."""
    from slime.utils.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny_model"), seed=0))


@pytest.fixture(scope="session")
def tiny_vl_model_dir(tmp_path_factory):
    """A tiny random Qwen2.5-VL (vision tower + text model), its tokenizer and image processor."""
    from slime.utils.tiny_model import build_tiny_vl_model

    return str(build_tiny_vl_model(tmp_path_factory.mktemp("tiny_vl_model"), seed=0))


@pytest.fixture(scope="session")
def tiny_moe_model_dir(tmp_path_factory):
    """A tiny random Qwen3-MoE model (2 MoE layers, 4 experts, top-2) with the tiny model's tokenizer."""
    from slime.utils.tiny_model import build_tiny_moe_model

    return str(build_tiny_moe_model(tmp_path_factory.mktemp("tiny_moe_model"), seed=0, family="qwen3_moe"))


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    """A failure's traceback printed when it happens, not only in the summary at the end: a CI run stopped
    by its time limit (pytest's summary never printed) still shows which test failed and why. Under
    pytest-xdist this runs in the controller, for each report a worker sends."""
    if not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):  # a worker's report reaches the controller
        return
    import sys

    when = "" if report.when == "call" else f" (in {report.when})"
    text = getattr(report, "longreprtext", "") or str(report.longrepr)
    sys.stderr.write(f"\n\n===== FAILED {report.nodeid}{when} =====\n{text[-6000:]}\n===== end of "
                     f"{report.nodeid} =====\n")
    sys.stderr.flush()
