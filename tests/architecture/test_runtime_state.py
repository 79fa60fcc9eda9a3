"""The runtime's state is explicit: every op of the IR has its method in a map a
reader can check (and the evaluation's ops too); the runtime's and the agents'
objects set every attribute in __init__ (an iteration's state lives in one object made
in one place); metrics events keep the JSON schema the metrics file always had."""
import ast
import inspect
import itertools
import json
import textwrap

import pytest

from schedules.compiler import compile_eval
from schedules.ir import Op

from agents import agent, membership
from commands.train import launcher
from bamboo.control.events import (EvalSkipped, Event, FailedOver, ModeSwitched, NoticeSeen, Overflow, Preemption,
                                   Reconfigured, Redone)
from bamboo.runtime import ahead, boundary, evaluator, executor, failover, reduce, steps, sync, worker
from bamboo.state import epochs, holdings


def test_every_op_has_its_method_in_the_executors_map():
    assert set(executor.OPS) == set(Op)
    for op, method in executor.OPS.items():
        assert method.__name__ == op.value and method is getattr(executor.Executor, op.value)


def test_the_evaluators_map_covers_every_op_an_evaluation_stream_uses():
    used = set()
    for P, M in itertools.product((2, 3, 4), (1, 2, 5)):
        for failed in [()] + [(d,) for d in range(P) if P > 2]:
            for stream in compile_eval(P, M, failed, "eager").streams.values():
                used |= {ins.op for ins in stream}
    assert used == set(evaluator.EVAL_OPS)
    for op, method in evaluator.EVAL_OPS.items():
        assert method.__name__ == op.value


def attributes_set_outside_init(cls, init_of=None) -> set[str]:
    """`self.x = ...` (or `self.x, ... = ...`) in a method other than __init__, for
    an x that __init__ does not set (a base's: the __init__ of `init_of`, the class
    it is a part of)."""
    by_method = _assigned_by_method(cls)
    in_init = _assigned_by_method(init_of).get("__init__", set()) if init_of else by_method.pop("__init__", set())
    return set().union(*by_method.values()) - in_init


def _assigned_by_method(cls) -> dict[str, set[str]]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    by_method = {}
    for fn in tree.body[0].body:
        if isinstance(fn, ast.FunctionDef):
            names = set()
            for node in ast.walk(fn):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
                for t in targets:
                    for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                            names.add(el.attr)
            by_method[fn.name] = names
    return by_method


@pytest.mark.parametrize("cls", [executor.Executor, failover.Failover, evaluator.Evaluator, worker.Worker,
                                 boundary.Boundary, reduce.Reducer, holdings.Holdings, launcher.Launcher,
                                 membership.Membership, agent.BambooAgent, steps.StepPhase, ahead.Ahead,
                                 sync.EarlySync], ids=lambda cls: cls.__name__)
def test_every_attribute_is_first_set_in_init(cls):
    assert attributes_set_outside_init(cls) == set()


def test_the_workers_epoch_moves_set_only_what_its_init_sets():
    assert epochs.EpochMoves in worker.Worker.__mro__
    assert attributes_set_outside_init(epochs.EpochMoves, init_of=worker.Worker) == set()
    assert attributes_set_outside_init(epochs.EpochMoves) >= {"failed", "comm"}  # the check sees them


def test_the_attribute_check_sees_an_attribute_first_set_elsewhere():
    class Scattered:
        def __init__(self):
            self.a = 1

        def run(self):
            self.a, self.b = 2, 3
            self.c: int = 4

    assert attributes_set_outside_init(Scattered) == {"b", "c"}


# The metrics file's events as they were written before they were typed records:
# the same keys, in the same order (a reader of metrics.jsonl sees no change).
SCHEMA = {
    "failover": ["type", "node", "iteration", "died_before", "by", "agree_seconds", "lent_by", "lent",
                 "lend_seconds"],  # lent_by, lent, lend_seconds: added last
    "redo": ["type", "abandoned", "from", "restore", "why"],
    "preemption": ["type", "node", "pause_seconds"],
    "notice": ["type", "node", "source", "action"],
    "reconfigure": ["type", "epoch", "pipelines", "standby", "redundancy", "microbatches", "sync"],  # sync: added last
    "mode": ["type", "epoch", "from", "to"],
    "overflow": ["type", "iteration", "loss_scale"],
    "eval_skipped": ["type", "iteration", "arrived", "of"],
}


def test_every_event_serialises_to_the_metrics_files_schema_and_back():
    samples = [FailedOver(3, 7, 12, 2, 0.25), Redone(9, 6, None), Preemption(1, 1.5),
               NoticeSeen(4, "ec2", "terminate"), Reconfigured(2, ((0, 1), (2, 3)), (4,), "eager", (2, 2)),
               ModeSwitched(2, "eager", "off"), Overflow(5, 1024.0), EvalSkipped(8, 1, 4)]
    assert {type(e) for e in samples} == set(Event.__subclasses__())
    for event in samples:
        line = json.loads(json.dumps(event.to_dict()))
        assert list(line) == SCHEMA[line["type"]]
        assert Event.from_json(line) == event or isinstance(event, Reconfigured)  # tuples come back as lists
    assert Redone(9, 6, 40).to_dict()["from"] == 6
