"""Shared test settings: hypothesis profile sized for a 2-core CI machine. In CI
(CI=true) the examples are derandomized, so a run there is repeatable; a local
run explores new examples each time."""
import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", deadline=None, max_examples=60, derandomize=bool(os.environ.get("CI")),
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")
