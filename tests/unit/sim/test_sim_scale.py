"""A fleet's month in a minute takes caches and quicker helpers; none may change a
figure. Every strategy over a generated 200-node trace gives the same result with
the simulator's memo (sim/memo.py) as without it, and its ledger adds up to the
node-hours it paid for; the quicker helpers give what their straightforward forms,
kept here, give on random inputs. (`--jobs` and the 1,000-node month:
tests/integration/test_sim_scale.py.)"""
import random
from itertools import chain
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schedules import syncs
from schedules.compiler import _compile, compile_schedule, simulate
from schedules.options import ScheduleOptions
from schedules.split import estimated_slots, split_by_speed
from schedules.timing.bubbles import makespan
from schedules.timing.fast import start_times

from agents.placement import choose, fill_holes, spread_order
from agents.policy import Config, Spread
from agents.surplus import BurstModel, assign_surplus, burst_order
from sim import bound, memo, simulator
from sim.capacity import spread_only, survivors
from sim.iteration_times import length
from sim.profiles import profile
from sim.reconfiguration import memory_copies, positions_dead, stages_moved
from sim.simulator import STRATEGIES, ClusterSimulator, Options
from sim.traces import synthetic

ZONES = ("a", "b", "c", "d")
FLEET = synthetic(8, 200, ZONES, 0.03, 7, bulk=0.05, refill_seconds=600)  # zones lost whole among them
GPT2 = replace(profile("gpt2"), microbatches=100)  # 50 pipelines of 4 stages, two microbatches each


def runs() -> dict[str, dict]:
    return {s: ClusterSimulator(GPT2, 4, s, Options()).run(FLEET, 8) for s in STRATEGIES}


@pytest.fixture(scope="module")
def kept() -> dict[str, dict]:
    """Each strategy's run with the memo, as bamboo-sim runs it."""
    return runs()


def test_the_memo_changes_no_figure_of_any_strategy(kept, monkeypatch):
    """Nor does a bound shared by strategies of one mode: each is computed again."""
    monkeypatch.setattr(memo.PolicyMemo, "get", lambda self, live, previous, key, plan: plan())
    monkeypatch.setattr(memo.Table, "__call__", lambda self, *args: self._compute(*args))
    monkeypatch.setattr(memo.ByKey, "get", lambda self, key, compute: compute())
    monkeypatch.setattr(memo.ByIdentity, "__call__", lambda self, arg: self._compute(arg))
    monkeypatch.setattr(simulator, "bound_of", bound._bound)
    assert runs() == kept
    assert all(kept[s]["preemptions"] > 100 for s in STRATEGIES if s != "on-demand")  # a zone of 50 among them


@pytest.mark.parametrize("seed, surplus", [(1, "burst"), (2, "keep"), (3, "keep")])  # keep: the nodes left over form a short pipeline
def test_what_the_policy_forms_after_a_burst_turns_on_each_pipelines_shape_and_survivors(seed, surplus):
    """The surplus rule keeps the throughput after a burst by `capacity.survivors`
    where the policy only spreads: any other survivors with each pipeline's count
    of them the same, in any zones, give the same configuration's throughput."""
    rng = random.Random(seed)
    sim = ClusterSimulator(GPT2, 4, "bamboo", Options(surplus=surplus))
    nodes = {f"n{i}": rng.choice(ZONES) for i in range(4 * rng.randrange(8, 15) + 2 + seed % 2)}
    sim.zones = dict(nodes)
    config = sim.next_config(nodes, None)
    assert spread_only(sim) and (surplus == "burst" or {len(set(p)) for p in config.pipelines} != {4})
    for _ in range(16):
        left = [n for pipe in config.pipelines for n in rng.sample(list(dict.fromkeys(pipe)), rng.randrange(
            len(set(pipe)) + 1))]
        other = [n for pipe in config.pipelines for n in rng.sample(list(dict.fromkeys(pipe)), sum(
            n in left for n in dict.fromkeys(pipe)))]
        used = set(chain.from_iterable(config.pipelines))
        assert survivors(config, used - set(left)) == survivors(config, used - set(other))
        throughputs = {sim.config_throughput(sim.next_config({n: rng.choice(ZONES) for n in nodes_left}, config))
                       for nodes_left in (left, other)}
        assert len(throughputs) == 1, (survivors(config, used - set(left)), throughputs)


def test_each_ledger_adds_up_to_the_node_hours_paid(kept):
    for strategy, run in kept.items():
        paid = run["mean_nodes"] * run["hours"]  # mean_nodes is rounded to 3 places
        assert sum(run["ledger"].values()) == pytest.approx(paid, abs=0.001 * run["hours"] + 0.01), strategy


def split_by_speed_as_it_was(total, pipelines, duration=estimated_slots):
    counts = [1] * len(pipelines)
    for _ in range(total - len(pipelines)):
        j = min(range(len(pipelines)), key=lambda j: (duration(pipelines[j], counts[j] + 1), j))
        counts[j] += 1
    return counts


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=8), st.integers(0, 30), st.integers(0, 2 ** 32))
def test_the_split_from_a_heap_is_the_split_pipeline_by_pipeline(lengths, extra, seed):
    """Shapes of 1..6 nodes; durations random and not monotone, so the heap must ask
    what the plain loop asks."""
    pipelines = [tuple(range(n)) for n in lengths]
    table: dict = {}
    rng = random.Random(seed)
    duration = lambda p, m: table.setdefault((p, m), rng.choice((1.0, 2.0, 3.0)) * m)  # noqa: E731
    total = len(pipelines) + extra
    for how in ((), (duration,)):
        assert [len(r) for r in split_by_speed(total, pipelines, *how)] == split_by_speed_as_it_was(total, pipelines,
                                                                                                    *how)


nodes = st.lists(st.sampled_from([f"n{i}" for i in range(40)]), min_size=1, max_size=40, unique=True)


@settings(max_examples=60, deadline=None)
@given(nodes, st.integers(0, 2 ** 32), st.integers(1, 40), st.integers(1, 6))
def test_placement_without_hosts_is_placement_with_one_host_a_node(names, seed, k, most):
    """The quicker round robin and orders (no host to keep apart) against the general
    code given each node as its own host."""
    rng = random.Random(seed)
    zones = {n: rng.choice(ZONES) for n in names}
    own = {n: n for n in names}
    assert choose(names, k, zones, None, most) == choose(names, k, zones, own, most)
    assert spread_order(names, zones, None) == spread_order(names, zones, own)
    count = rng.randint(1, len(names))
    assert Spread(zones, None).deal(names, count) == Spread(zones, own).deal(names, count)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2 ** 32), st.integers(2, 6), st.integers(1, 5), st.booleans())
def test_holes_filled_without_hosts_are_filled_as_with_one_host_a_node(seed, depth, count, pack):
    """The quick fill (each hole's first choice, found by a scan) against the search
    given each node as its own host; pipelines with holes next to each other."""
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(depth * count + rng.randint(0, 8))]
    rng.shuffle(names)
    zones = {n: rng.choice(ZONES[:rng.randint(1, 4)]) for n in names}
    partial = [[n if rng.random() < 0.6 else None for n in names[j * depth:(j + 1) * depth]] for j in range(count)]
    spares = names[depth * count:] + [n for n in names[:depth * count] if rng.random() < 0.1 and
                                       all(n not in p for p in partial)]
    own = {n: n for n in names}
    quick, quick_spares = [list(p) for p in partial], list(spares)
    fill_holes(quick, quick_spares, zones, None, pack)
    fill_holes(partial, spares, zones, own, pack)
    assert (quick, quick_spares) == (partial, spares)


def assign_surplus_as_it_was(idle, trainers, standby):
    load = {zone: 0 for zone in idle.values()}
    for zone in trainers.values():
        if zone in load:
            load[zone] += 1
    kept, left = [], sorted(idle)
    while left and len(kept) < standby:
        node = min(left, key=lambda n: (load[idle[n]], idle[n], n))
        kept.append(node)
        left.remove(node)
        load[idle[node]] += 1
    return tuple(kept), tuple(n for n in sorted(idle) if n not in kept)


@settings(max_examples=60, deadline=None)
@given(nodes, nodes, st.integers(0, 45), st.integers(0, 2 ** 32))
def test_surplus_and_burst_order_are_their_straightforward_forms(idle, trainers, standby, seed):
    rng = random.Random(seed)
    idle_zones = {n: rng.choice(ZONES) for n in idle}
    trainer_zones = {n: rng.choice(ZONES) for n in trainers}
    roles = assign_surplus(idle_zones, trainer_zones, standby)
    assert (roles.standby, roles.release) == assign_surplus_as_it_was(idle_zones, trainer_zones, standby)
    count = {z: list(trainer_zones.values()).count(z) for z in ZONES}
    assert burst_order(trainer_zones) == sorted(trainer_zones, key=lambda n: (-count[trainer_zones[n]],
                                                                              trainer_zones[n], n))


@given(st.lists(st.integers(1, 30), max_size=60), st.floats(0, 2))
def test_the_burst_sizes_distribution_is_counted_as_before(sizes, prior):
    weights = [0.0] * (max(sizes, default=1) + 1)
    weights[1] += prior
    for size in sizes:
        weights[size] += 1
    total = sum(weights)
    assert BurstModel(tuple(sizes), 60.0, prior).size_distribution() == ([w / total for w in weights] if total
                                                                          else weights)


def memory_copies_as_they_were(config, zones):
    pipe = config.pipelines[0]
    P = len(pipe)
    others = [n for p in config.pipelines[1:] for n in p]
    out = {}
    for s in range(P):
        near = {pipe[(s + d) % P] for d in (-1, 0, 1)}
        candidates = list(dict.fromkeys(n for n in [pipe[(s + k) % P] for k in range(2, P)] + others
                                        if n not in near))
        away = [n for n in candidates if zones.get(n) != zones.get(pipe[s])]
        apart = [n for n in away if zones.get(n) != zones.get(pipe[(s - 1) % P])]
        out[s] = {pipe[s]} | set((apart or away or candidates)[:1])
    return out


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2 ** 32), st.integers(2, 6), st.integers(1, 5))
def test_configuration_helpers_are_their_straightforward_forms(seed, depth, count):
    rng = random.Random(seed)
    names = [f"n{i}" for i in range(depth * count + 3)]
    rng.shuffle(names)
    a = Config(0, depth, tuple(tuple(names[j * depth:(j + 1) * depth]) for j in range(count)))
    rng.shuffle(names)
    b = Config(1, depth, tuple(tuple(names[j * depth:(j + 1) * depth]) for j in range(count)))
    zones = {n: rng.choice(ZONES[:rng.randint(1, 4)]) for n in names}
    removed = set(rng.sample(names, rng.randint(0, 4)))
    assert memory_copies(a, zones) == memory_copies_as_they_were(a, zones)
    for x, y in ((a, b), (a, a), (b, a)):
        pairs = {(n, s) for pipe in x.pipelines for s, n in enumerate(pipe)}
        assert stages_moved(x, y) == any((n, s) not in pairs for pipe in y.pipelines for s, n in enumerate(pipe))
    assert positions_dead(a, removed) == [{i for i, n in enumerate(p) if n in removed} for p in a.pipelines]


@pytest.mark.parametrize("redundancy, sync, merged", [("eager", "end", ()), ("eager", "next", (2,)),
                                                       ("lazy", "next", ()), ("off", "end", (1, 3))])
def test_an_iteration_s_length_is_the_engine_s_makespan(redundancy, sync, merged):
    """The simulator times compiled iterations by the engine's timing rule without
    its checks; the checked engine gives the same number."""
    for pipelines, microbatches in ((1, 5), (7, 3)):
        schedule = compile_schedule(6, microbatches, merged, ScheduleOptions(redundancy=redundancy, sync=sync),
                                    GPT2.cost(6, pipelines))
        assert length(schedule) == simulate(schedule).makespan


least_delay = syncs._least_delay


def least_delay_as_it_was(base, node, places, ops):
    streams, cost = base.streams, base.cost

    def ending(i):
        trial = {**streams, node: streams[node][:i] + ops + streams[node][i:]}
        return makespan(trial, start_times(trial, cost), cost)
    places = [*places, len(streams[node])]
    times = [ending(i) for i in places]
    return places[times.index(min(times))]


@pytest.mark.parametrize("redundancy", ["eager", "lazy"])
def test_late_syncs_are_placed_as_when_every_place_was_timed(redundancy, monkeypatch):
    """The whole-iteration search for a late sync stops at the first place that
    delays nothing; timing every place puts each sync in the same place."""
    shapes = [(4, 3, (), 1), (6, 5, (2,), 3)] + [(12, m, merged, 83) for m in range(2, 10) for merged in ((), (3,))]
    options = ScheduleOptions(redundancy=redundancy, sync="next")
    searched = []
    _compile.cache_clear()
    monkeypatch.setattr(syncs, "_least_delay", lambda *a: searched.append(a) or least_delay(*a))
    quick = [compile_schedule(d, m, f, options, GPT2.cost(d, p)).streams for d, m, f, p in shapes]
    _compile.cache_clear()
    monkeypatch.setattr(syncs, "_least_delay", least_delay_as_it_was)
    assert [compile_schedule(d, m, f, options, GPT2.cost(d, p)).streams for d, m, f, p in shapes] == quick
    _compile.cache_clear()
    assert len(searched) > 20
