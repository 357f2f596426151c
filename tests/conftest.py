import os

from hypothesis import HealthCheck, settings

# CI: derandomised (same examples every run), no deadline (torch's first calls are slow)
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
settings.load_profile("ci" if os.environ.get("CI") else "dev")
