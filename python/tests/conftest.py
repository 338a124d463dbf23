"""pytest set-up: import mok from this checkout (python/) when it is not installed,
and seed torch for every test (the seed is printed on failure)."""
import os
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:
    import mok  # noqa: F401
except ImportError as e:
    if "No module named 'mok'" not in str(e):
        raise
    sys.path.insert(0, os.path.dirname(HERE))

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")

import pytest  # noqa: E402
import torch  # noqa: E402

SEED = int(os.environ.get("MOK_TEST_SEED", "1234"))


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(SEED)
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print(f"\n[mok test seed: MOK_TEST_SEED={SEED}]")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
