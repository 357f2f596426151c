import importlib.util
import os

import pytest
import torch

# pytester's in-process sessions drop from sys.modules every module first imported inside them.
# Entering a TorchDispatchMode (the alignment lint, the first-fault tracer) imports torch._dynamo
# and with it triton, whose nanobind extension aborts the process when it is imported a second
# time. So both are imported here, once, outside any session. Triton fixes its mode at import:
# without CUDA it is imported under TRITON_INTERPRET=1 so tests/test_kernels.py can run the
# kernels, and the variable is then restored, so pytester sessions (which read it to decide
# whether the suites list the kernels) see what the user set.
if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    _saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import triton  # noqa: F401,E402
    # the bf16 emulation and the canary's kernels, for the same reason (and jitted in interpreter mode)
    import pytest_precision.platform.interpreter_bf16  # noqa: F401,E402
    import pytest_precision.platform.triton_canary  # noqa: F401,E402

    if _saved is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _saved
import torch._dynamo  # noqa: F401,E402

# the built-in training target, for the same reason: a session that imports it first would drop it,
# while the kind registry keeps its TrainSpec, whose model_fn the DDP ranks import by name
import pytest_precision.suites.tiny_gpt  # noqa: F401,E402
from hypothesis import HealthCheck, settings  # noqa: E402

# CI: derandomised (same examples every run), no deadline (torch's first calls are slow)
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
settings.load_profile("ci" if os.environ.get("CI") else "dev")

# Modules the harness imports lazily (the drawn regime's strategies, the property helpers, the
# training goldens, the JSON report): imported once here, after the profile is loaded, so that no
# pytester session is the first to import them and drops them when it ends, leaving later sessions
# in the same process (an xdist worker) a second copy of their classes and Hypothesis profile.
import pytest_precision.properties  # noqa: F401,E402
import pytest_precision.reporting.report  # noqa: F401,E402
import pytest_precision.strategies  # noqa: F401,E402
import pytest_precision.training.baseline  # noqa: F401,E402
import pytest_precision.training.limits  # noqa: F401,E402

# Under pytest -n, each worker's torch gets its share of the cores, and so do the processes its tests
# start (pytest subprocesses, through OMP_NUM_THREADS): with torch's default of one OpenMP thread
# per core, 2 workers on 2 cores run 4 threads whose spin-waits burn the cores the other worker
# needs. tests/test_cross_entropy_suite.py under -n 2 on this 2-core machine, busy with other
# work: 118 to 144 s (76 to 92 s user CPU) with the default, 46 s (27 s) with one thread each. A
# serial run keeps torch's default. Goldens are written and checked under one setting, or are
# committed ones, whose budgets hold across thread counts (tests/test_machines.py).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = str(max(1, len(os.sched_getaffinity(0)) // _WORKERS))
    torch.set_num_threads(int(_THREADS))
    os.environ.setdefault("OMP_NUM_THREADS", _THREADS)

# The sessions the tests run draw the fresh regime's inputs from one seed, so that their counts and
# messages are the same on every run (a user's run draws a new one each time: kinds/fresh.py). The
# tests of the fresh regime itself pass --precision-fresh-seed on their command line (the last one
# given wins) or ask for ``unpinned_fresh_seed``. PYTEST_ADDOPTS reaches the pytest processes tests
# start (set here, before any starts); pytester clears it when it is set up, so its in-process and
# subprocess sessions get it again after that.
TEST_FRESH_SEED = 1
PINNED = f"--precision-fresh-seed={TEST_FRESH_SEED}"
os.environ["PYTEST_ADDOPTS"] = f"{os.environ.get('PYTEST_ADDOPTS', '')} {PINNED}".strip()


# Tests marked ``slow`` run with PRECISION_SLOW=1 and are skipped otherwise, naming what covers their
# ground in the default run (the README's test command, which CI runs within its time limit):
# ``@pytest.mark.slow(reason="...")``.
SLOW = os.environ.get("PRECISION_SLOW", "") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    if SLOW:
        return
    for item in items:
        mark = item.get_closest_marker("slow")
        if mark is not None:
            why = mark.kwargs.get("reason", "")
            item.add_marker(pytest.mark.skip(reason=f"slow: PRECISION_SLOW=1 runs it{'; ' + why if why else ''}"))


@pytest.fixture(autouse=True)
def _pinned_fresh_seed(request, monkeypatch):
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester")
        monkeypatch.setenv("PYTEST_ADDOPTS", PINNED)


@pytest.fixture
def unpinned_fresh_seed(monkeypatch):
    """Sessions that draw a new fresh seed, as a user's run does."""
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)
