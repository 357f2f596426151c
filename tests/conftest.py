import os

import torch._dynamo  # noqa: F401  (see below)
from hypothesis import HealthCheck, settings

# pytester's in-process sessions drop from sys.modules every module first imported inside them.
# Entering a TorchDispatchMode (the alignment lint, the first-fault tracer) imports torch._dynamo
# and with it triton, whose nanobind extension aborts the process when it is imported a second
# time. Importing them here, outside any session, keeps them loaded once.

# CI: derandomised (same examples every run), no deadline (torch's first calls are slow)
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
settings.load_profile("ci" if os.environ.get("CI") else "dev")
