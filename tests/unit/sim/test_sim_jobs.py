"""`bamboo-sim --jobs`: auto (the default) is the CPUs this process may run on, and
what each process runs is the whole list once."""
import os

import pytest

from sim.command import build_parser
from sim.runs import ORDER, jobs_of, shares


def test_auto_is_the_cpus_this_process_may_run_on_and_the_default():
    assert build_parser().parse_args([]).jobs == "auto"
    assert jobs_of("auto") == len(os.sched_getaffinity(0))
    assert jobs_of("1") == 1 and jobs_of("16") == 16


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", ""])
def test_a_count_below_one_or_not_a_count_is_refused(value):
    with pytest.raises(ValueError, match=r"--jobs must be at least 1, or auto"):
        jobs_of(value)


@pytest.mark.parametrize("jobs", [1, 2, 3, 8])
def test_each_strategy_runs_once_whatever_the_count(jobs):
    parts = shares(list(ORDER), jobs)
    assert sorted(s for part in parts for s in part) == sorted(ORDER) and all(parts)
    assert len(parts) == {1: 1, 2: 2}.get(jobs, len(ORDER))  # beyond two, one strategy a task, the longest first
