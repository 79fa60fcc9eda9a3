"""Architecture tests, like unit tests, run in this process alone: the same guard
as tests/unit/conftest.py's, registered here too."""
from tests.unit.conftest import _no_processes, pytest_runtest_setup  # noqa: F401  (a fixture and a hook)
