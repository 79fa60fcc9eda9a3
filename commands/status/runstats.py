"""What a look at a job's etcd (commands/status/jobview.py) says about the run, as
plain JSON-able dicts: the pipelines x stages grid of each epoch with each node's
state, the per-iteration series, the events with the pause each cost, the cost
and the goodput, and `auto`'s estimates. Pure functions: the dashboard renders
them and serves them as JSON.

Times come from the workers' reports: an iteration lasted from the previous
one's last report to its own last report (the first iteration's start is not in
etcd, so it has no time). An event's pause is how much longer than the median
undisturbed iteration its iteration took.
"""
from __future__ import annotations

import statistics
from collections import defaultdict

from bamboo.control.assignment import Restore
from bamboo.control.config import Redundancy
from bamboo.control.protocol import STRAGGLER

# A node recorded dead without being seen to die (found silent, or slow) may still
# run: etcd refuses its writes, and a machine that comes back registers as a new node.
# known alive, cut off; a silent node (lease expired, host lost) is dead as far as anyone sees
FENCED_HOW = (STRAGGLER,)


def node_state(look, node: int) -> str:
    """training, standby, draining, dead, fenced, or left (it drained and its agent
    stopped, or it holds no place now)."""
    if node in look.failed:
        return "fenced" if look.failed[node].how in FENCED_HOW else "dead"
    if node in look.drains:
        return "left" if node in look.left else "draining"
    newest = look.assignments[max(look.assignments)] if look.assignments else None
    if newest and node in newest.members:
        return "training"
    if newest and node in newest.standby:
        return "standby"
    return "left"


def _place(look, node: int) -> dict:
    zone = look.zones.get(node)
    member = look.members.get(node)
    return {"node": node, "state": node_state(look, node), "zone": zone.zone if zone else "?",
            "host": (zone.host if zone else "") or (member.host if member else "") or "own machine"}


def grid(look, epoch: int) -> dict:
    """Epoch `epoch` as pipelines x stages: each cell the node, its state now, zone,
    host, what it holds beyond the stage it runs, and who held the place before."""
    a = look.assignments[epoch]
    mode = a.mode(look.cfg.schedule.redundancy)
    before = look.assignments.get(max((e for e in look.assignments if e < epoch), default=-1))
    rows = []
    for j, pipe in enumerate(a.pipelines):
        row = []
        for s, node in enumerate(pipe):
            cell = _place(look, node)
            runs = [t for t, n in enumerate(pipe) if n == node]
            extra = [t for t in a.stages_of(node, mode) if t not in runs]
            cell["holds"] = (f"stages {runs[0]}-{runs[-1]}, no replica" if len(runs) > 1 else
                             f"replica of stage {extra[0]}" if extra else "no replica")
            if s != runs[0]:
                cell["holds"] = f"its second stage (with stage {runs[0]})"
            old = before.pipelines[j][s] if before and j < len(before.pipelines) and s < before.depth else None
            if old is not None and old != node:
                cell["replaces"] = {"node": old, "state": node_state(look, old)}
            row.append(cell)
        rows.append(row)
    return {"epoch": epoch, "start": a.start, "mode": mode, "sync": look.cfg.schedule.epoch_sync(a),
            "restore": a.restore, "redo": a.redo,
            "pipelines": rows, "standby": [_place(look, n) for n in a.standby]}


def iterations(look) -> list[dict]:
    """One dict per complete iteration: its time (None for the first seen), loss,
    validation loss, samples/s and live nodes."""
    cfg, out, prev = look.cfg, [], None
    samples = cfg.schedule.samples
    for f in look.done:
        seconds = f.end - prev.end if prev is not None and prev.iteration == f.iteration - 1 else None
        out.append({"iteration": f.iteration, "end": f.end, "seconds": seconds, "loss": f.loss,
                    "val_loss": f.val_loss, "samples": samples, "live": f.live, "epoch": f.epoch,
                    "samples_per_second": samples / seconds if seconds else None})
        prev = f
    return out


def _undisturbed(look, series: list[dict]) -> list[tuple[dict, object]]:
    """(series row, Finished) of the timed iterations that had no failover and
    start no epoch; every timed one when none is so calm."""
    starts = {a.start for a in look.assignments.values()}
    timed = [(r, f) for r, f in zip(series, look.done) if r["seconds"]]
    return [(r, f) for r, f in timed if not f.events and f.iteration not in starts] or timed


def typical_seconds(look, series: list[dict]) -> float | None:
    """The median time of an undisturbed iteration."""
    calm = _undisturbed(look, series)
    return statistics.median(r["seconds"] for r, _ in calm) if calm else None


def pauses(series: list[dict], typical: float | None) -> dict[int, float]:
    """iteration -> seconds beyond the typical iteration."""
    if typical is None:
        return {}
    return {r["iteration"]: round(max(0.0, r["seconds"] - typical), 4) for r in series if r["seconds"]}


def events(look, series: list[dict], paused: dict[int, float], typical: float | None = None) -> list[dict]:
    """The timeline, in order: deaths, failovers, epochs (reconfigure, redo,
    rollback, mode switch), notices and drains, each with its iteration's pause
    (a failover on lent gradients also with the redo it spared: `typical`, an
    undisturbed iteration's seconds, again after the failure timeout)."""
    ends = {r["iteration"]: r["end"] for r in series}
    out = []

    def add(kind: str, it: int | None, text: str, **more) -> None:
        out.append({"type": kind, "iteration": it, "time": more.pop("time", ends.get(it)),
                    "pause": paused.get(it) if it is not None else None, "text": text, **more})
    for node, f in sorted(look.failed.items()):
        kind = "fenced" if f.how in FENCED_HOW else "preemption"
        how = "injected (--preempt)" if node in look.preempted else f.how or "?"
        add(kind, f.iteration, f"node {node} recorded dead by node {f.by}: {how}", node=node)
    for f in look.done:
        for e in f.events:
            if e.get("type") == "failover":
                add("failover", f.iteration, f"node {e['by']} took node {e['node']}'s stage over (agreed in "
                    f"{e['agree_seconds']:.3f} s)" + _loan(e, look.cfg.faults.failure_timeout, typical),
                    node=e["node"], by=e["by"])
    _epoch_events(look, add)
    for node, n in sorted(look.notices.items()):
        add("notice", _iteration_at(series, n.time), f"{n.source} preemption notice for node {node}"
            + (f": {n.action}" if n.action else ""), node=node, time=n.time)
    for node, d in sorted(look.drains.items()):
        add("drain", _iteration_at(series, d.time), f"node {node} asked to leave", node=node, time=d.time)
    return sorted(out, key=lambda e: (e["iteration"] if e["iteration"] is not None else 1 << 60,
                                      EVENT_ORDER.index(e["type"])))


def _loan(event: dict, timeout: float, typical: float | None) -> str:
    """What a failover in a late sync's window borrowed, and the redo that spared."""
    if event.get("lent_by") is None:
        return ""
    redo = "" if typical is None else f" (a redo would take about {timeout + typical:.3f} s: the failure " \
        f"timeout, then the iteration again)"
    return f" with its stage's {event.get('lent')} gradients lent by node {event['lent_by']} in " \
        f"{event.get('lend_seconds', 0.0):.3f} s instead of a redo" + redo


EVENT_ORDER = ("start", "notice", "drain", "preemption", "fenced", "failover", "redo", "rollback", "reconfigure",
               "mode")


def _epoch_events(look, add) -> None:
    """One event per epoch: start, reconfigure, redo (from peers) or rollback (to a
    checkpoint or its copies); and a mode switch with what `auto` estimated."""
    from agents.modes import epoch_setting, setting
    previous = None
    for epoch, a in sorted(look.assignments.items()):
        mode = epoch_setting(look.cfg.schedule, a)
        shape = f"{len(a.pipelines)} pipeline(s) {[list(p) for p in a.pipelines]}, standby {list(a.standby)}"
        if previous is None:
            add("start", a.start, f"epoch {epoch}: {shape}, {mode}", epoch=epoch)
        elif a.redo:
            kind = "redo" if a.restore == Restore.PEERS else "rollback"
            why = f" (why: {a.why})" if a.why else ""
            add(kind, a.start, f"epoch {epoch} runs iteration {a.start} again, layers from {a.restore}: {shape}{why}",
                epoch=epoch)
        else:
            add("reconfigure", a.start, f"epoch {epoch}: {shape}", epoch=epoch)
        if previous is not None and mode != previous:
            choice = max((it for it, m in look.modes.items()
                          if it < a.start and setting(m.mode, m.sync or look.cfg.schedule.fixed_sync) == mode),
                         default=None)
            add("mode", a.start, f"redundancy {previous} -> {mode}" + (f" (auto's choice after iteration {choice})"
                                                                      if choice is not None else ""),
                epoch=epoch, estimates=auto_estimates(look, choice) if choice is not None else None)
        previous = mode


def _iteration_at(series: list[dict], when: float) -> int | None:
    """The first iteration that ended at or after `when`."""
    return next((r["iteration"] for r in series if r["end"] >= when), None)


def auto_estimates(look, iteration: int | None = None) -> dict | None:
    """What `--redundancy auto` weighed after `iteration` (default: the newest):
    each mode's iteration seconds, seconds per death and expected seconds per
    iteration at the observed death rate, and the mode it chose."""
    from agents.modes import ModeStats, expected_seconds, job_estimates, setting, weighed_pauses
    if not look.modes:
        return None
    it = max(look.modes) if iteration is None else iteration
    choice, cfg = look.modes[it], look.cfg
    stats = ModeStats(**choice.stats)
    epoch = max(look.assignments.values(), key=lambda a: a.epoch) if look.assignments else None
    depth, pipelines = (epoch.depth, len(epoch.pipelines)) if epoch else (cfg.schedule.stages, cfg.schedule.pipelines)
    seconds, pause, rollback = job_estimates(cfg, stats, depth, pipelines)
    pause = weighed_pauses(pause, pipelines, rollback)
    rate = stats.rate(cfg.schedule.auto_prior_rate, cfg.schedule.auto_prior_hours)
    nodes = len(epoch.members) if epoch else cfg.schedule.stages
    chosen = setting(choice.mode, choice.sync or cfg.schedule.fixed_sync)
    return {"iteration": it, "chosen": chosen, "rate_per_node_hour": rate, "deaths": stats.dead,
            "modes": {m: {"seconds": seconds[m], "pause": pause[m],
                          "expected": expected_seconds(seconds[m], pause[m], rate, nodes)} for m in seconds}}


def ledger(look, series: list[dict], paused: dict[int, float]) -> dict[str, float]:
    """Paid node-seconds by what they went to. In the timed iterations (`_book`):
    the nodes with a stage train (the share `redundant_share` of it as redundancy),
    but for the iteration's pause beyond the typical one, booked by its cause
    (`_pause_cause`; an iteration run again after a redo or a rollback first books
    what was trained from its start until the death as `redone work`); the nodes
    in standby wait. Outside them, from each node's paid span
    (`paid_spans`): its `start-up` before the first iteration booked to it (process
    start, model build, the untimed first iteration) and its `leaving` after the
    last (a release's drain, the job's end, a death's detection). A node the job
    asked for later (not of the first epoch) books its boot and joining, to its first
    iteration's end less the typical iteration, as `acquisition waits` instead."""
    starts = {a.start: a for a in look.assignments.values()}
    spans = paid_spans(look)
    first = look.assignments[min(look.assignments)] if look.assignments else None
    founders = {*first.members, *first.standby} if first else set()
    since = {node: span[0] for node, span in spans.items()}
    deaths = sorted(look.preempted[n].time if n in look.preempted else f.time for n, f in look.failed.items())
    parts: dict[str, float] = defaultdict(float)
    booked: dict[int, list[float]] = {}  # node -> [first booked second, seconds booked]
    shares: dict[int, float] = {}  # epoch -> the share of its training that is redundancy
    for r, f in zip(series, look.done):
        if not r["seconds"]:
            continue
        a, begun = look.assignments[f.epoch], starts.get(r["iteration"])
        if a.epoch not in shares:
            shares[a.epoch] = redundant_share(look, a)
        pause = min(r["seconds"], paused.get(r["iteration"], 0.0))
        redone = _redone(deaths, r) if begun is not None and begun.redo else 0.0
        pieces = ((min(pause, redone), "redone work"), (pause - min(pause, redone), _pause_cause(begun, f)))
        _book(look, r, a, pieces, shares[a.epoch], since, founders, (parts, booked))
    for node, (since, end) in spans.items():
        start, seconds = booked.get(node, (end, 0.0))
        unbooked = max(0.0, end - since - seconds)
        before = min(unbooked, max(0.0, start - since))
        parts["start-up" if node in founders or not founders else "acquisition waits"] += before
        parts["leaving"] += unbooked - before
    return {part: seconds for part, seconds in parts.items() if seconds}


def _redone(deaths: list[float], r: dict) -> float:
    """Of an iteration run again (`r`: it spans the first runs since the iteration
    it starts from, the death, the recovery and the run again), the seconds trained
    before the first death in it: thrown away, as the samples they trained."""
    began = r["end"] - r["seconds"]
    death = next((t for t in deaths if began < t <= r["end"]), None)
    return death - began if death is not None else 0.0


def _book(look, r: dict, a, pieces: tuple[tuple[float, str], ...], share: float, since: dict, founders: set,
          tally: tuple[dict, dict]) -> None:
    """One timed iteration `r` of epoch `a` into `tally` (parts, booked): each node of
    it (standby included; not dead before it, nor gone), from its process start
    (`since`) if later. A node with a stage trains, the `share` of it as redundancy,
    but for its share of the pause: the `pieces` (seconds, cause) one after the
    other from the iteration's start, each to its cause; a node joining (in its
    first iteration, not of the `founders`) books that share as acquisition
    waits, whatever its role."""
    parts, booked = tally
    began = r["end"] - r["seconds"]
    for n, role in [(n, "training") for n in a.members] + [(n, "standby") for n in a.standby]:
        if (n in look.failed and look.failed[n].iteration < r["iteration"]) or (
                n in look.left and look.left[n].time <= began):
            continue
        start = max(began, since.get(n, began))  # a newcomer is paid from its start
        seconds, late, at = r["end"] - start, start - began, 0.0
        new = bool(founders) and n not in founders and n not in booked
        waited = 0.0
        for length, cause in pieces:  # its share of each piece of the pause: the part after its start
            part = min(seconds - waited, max(0.0, at + length - max(at, late)))
            at += length
            if part > 0 and (role == "training" or new):
                parts["acquisition waits" if new else cause] += part
                waited += part
        if role == "training":
            parts["training"] += (seconds - waited) * (1 - share)
            parts["redundancy"] += (seconds - waited) * share
        else:
            parts["standby"] += seconds - waited
        first, total = booked.get(n, (start, 0.0))
        booked[n] = [min(first, start), total + seconds]


def redundant_share(look, epoch) -> float:
    """The share of an iteration of `epoch` that its redundancy adds (FRC, swaps,
    replica syncs): 1 - an off iteration's seconds over its mode's, from the times
    auto measured where it ran (the newest choice before the epoch) and the cost
    model's ratios elsewhere (agents/modes.py `job_estimates`)."""
    from agents.modes import ModeStats, epoch_setting, job_estimates
    if epoch.mode(look.cfg.schedule.redundancy) == Redundancy.OFF or not epoch.pipelines:
        return 0.0
    before = [it for it in look.modes if it < epoch.start]
    stats = ModeStats(**look.modes[max(before)].stats) if before else ModeStats()
    seconds, _, _ = job_estimates(look.cfg, stats, epoch.depth, len(epoch.pipelines))
    ran = epoch_setting(look.cfg.schedule, epoch)  # read from etcd, untrusted: an unknown one adds nothing
    return max(0.0, 1 - seconds[Redundancy.OFF] / seconds[ran]) if seconds.get(ran, 0) > 0 else 0.0


def _pause_cause(begun, finished) -> str:
    """Why an iteration took longer than the typical one: the epoch it begins, else a
    failover in it, else the checkpoint taken at the boundary before it (its
    snapshot and memory copies fall in its time), else a slowdown."""
    if begun is not None and begun.epoch:
        return ("redo" if begun.restore == Restore.PEERS else "rollback") if begun.redo else "reconfiguration"
    if finished.events:
        return "failover"
    return "checkpoint writes" if finished.checkpointed else "slowdown"


def paid_spans(look) -> dict[int, tuple[float, float]]:
    """Each node's paid time (wall clock), from its agent's process start (ZONES) to
    its end: an injected kill's time, else its agent's LEFT, else the time its death
    was recorded (detection comes a failure timeout after the death), else now.
    Nodes of agents that did not stamp their start are left out."""
    spans = {}
    for node, zone in look.zones.items():
        if not zone.since:
            continue
        if node in look.preempted:
            end = look.preempted[node].time
        elif node in look.left:
            end = look.left[node].time
        elif node in look.failed and look.failed[node].time:
            end = look.failed[node].time
        else:
            end = look.at
        spans[node] = (zone.since, max(zone.since, end))
    return spans


def cost(look, series: list[dict], price: tuple, paused: dict[int, float]) -> dict:
    """Paid node-hours (every node of the epoch, standby included, until it died)
    and what they went to, goodput, and with prices (`price`: spot and on-demand per
    node-hour, and optionally cross-zone per GiB) the cost so far, per million
    samples, projected to the job's end, what the same samples would cost on
    on-demand nodes, and the bytes sent and those between zones."""
    parts = ledger(look, series, paused)
    node_seconds = sum(parts.values())
    samples = sum(r["samples"] for r in series if r["seconds"])
    per_node = _fault_free_per_node(look, series)
    out = {"node_hours": node_seconds / 3600, "samples": samples, "fault_free_per_node": per_node,
           "ledger": {part: seconds / 3600 for part, seconds in sorted(parts.items())},
           "goodput": samples / node_seconds / per_node if node_seconds and per_node else None,
           "spot_price": price[0], "on_demand_price": price[1]}
    total = look.cfg.schedule.iterations * look.cfg.schedule.samples  # the whole job's samples
    if price[0] is not None and samples:
        out["spot"] = out["node_hours"] * price[0]
        out["spot_per_million"] = out["spot"] / samples * 1e6
        out["spot_projected"] = out["spot"] / samples * total
    if price[1] is not None and per_node:
        out["on_demand"] = samples / per_node / 3600 * price[1]
        out["on_demand_per_million"] = price[1] / per_node / 3600 * 1e6
        out["on_demand_projected"] = total / per_node / 3600 * price[1]
    out["network"] = network(look, price[2] if len(price) > 2 else None)
    return out


def network(look, per_gib: float | None) -> dict:
    """The bytes the workers' counters say they sent, by kind, those of them that
    crossed a zone (commands/status/network.py), and with a price per GiB their dollars."""
    sent, crossed = look.network.get("sent", {}), look.network.get("crossed", {})
    out = {"sent_bytes": sum(sent.values()), "cross_zone_bytes": sum(crossed.values()),
           "by_kind": {kind: {"sent": sent[kind], "crossed": crossed.get(kind, 0.0)} for kind in sorted(sent)},
           "cross_zone_price": per_gib}
    if per_gib is not None:
        out["cross_zone_dollars"] = out["cross_zone_bytes"] / 2 ** 30 * per_gib
    return out


def _fault_free_per_node(look, series: list[dict]) -> float | None:
    """Samples per second per training node in an undisturbed iteration (the median)."""
    calm = _undisturbed(look, series)
    return statistics.median(r["samples"] / r["seconds"] / len(look.assignments[f.epoch].members)
                             for r, f in calm) if calm else None


def summary(look, price: tuple[float | None, float | None] = (None, None), epochs: int = 4) -> dict:
    """Everything the dashboard shows, from one look."""
    cfg = look.cfg
    series = iterations(look)
    typical = typical_seconds(look, series)
    paused = pauses(series, typical)
    timeline = events(look, series, paused, typical)
    last = series[-1]["iteration"] if series else None
    shown = sorted(look.assignments)[-epochs:]
    known = sorted(set(look.zones) | {n for a in look.assignments.values() for n in (*a.members, *a.standby)})
    s = cfg.schedule
    return {"job": look.job, "at": look.at, "model": cfg.model.name, "stages": s.stages,
            "microbatches": s.microbatches, "batch": s.batch, "iterations": s.iterations,
            "state": "finished" if last is not None and last >= s.iterations - 1 else
                     "running" if look.assignments else "configured",
            "last_iteration": last, "typical_seconds": typical,
            "counts": {k: sum(e["type"] == k for e in timeline) for k in EVENT_ORDER if k != "start"},
            "epochs": [grid(look, e) for e in shown],
            "nodes": [_place(look, n) for n in known],
            "series": series, "events": timeline, "cost": cost(look, series, price, paused),
            "auto": auto_estimates(look)}
