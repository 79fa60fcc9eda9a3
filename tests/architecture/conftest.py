"""Architecture tests, like unit tests, run in this process alone: a test that
starts a process (a worker, etcd, a server) or asks for one (the etcd and
object-store fixtures) belongs in tests/integration/. Enforced here, so that
`make test-unit` stays fast."""
import multiprocessing.process
import subprocess

import pytest

SERVERS = {"etcd", "moto_endpoint", "s3", "gcs"}  # tests/conftest.py's fixtures that start one


def _refuse(*args, **kwargs):
    raise AssertionError("a unit test starts no process: move it to tests/integration/")


def pytest_runtest_setup(item):
    asked = SERVERS & set(getattr(item, "fixturenames", ()))
    if asked:
        pytest.fail(f"a unit test asks for {', '.join(sorted(asked))}: move it to tests/integration/",
                    pytrace=False)


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse)
