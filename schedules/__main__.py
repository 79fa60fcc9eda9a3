"""`python -m schedules dump|render|simulate|demo`: the compiler from the command line.

Bad arguments print one error line on stderr and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from schedules.compiler import REDUNDANCY, compile_eval, compile_recovery, compile_schedule, simulate
from schedules.cost import CostModel
from schedules.early_grads import SPLITS
from schedules.layout import ScheduleError
from schedules.order import ORDERS
from schedules.redundancy import FRC_MODES
from schedules.syncs import SYNC_MODES
from schedules.options import Redundancy, ReplicaSync, ScheduleOptions


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + error
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _schedule_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stages", "-P", type=int, default=4, help="pipeline depth P (default 4)")
    p.add_argument("--microbatches", "-M", type=int, default=8, help="microbatches per iteration (default 8)")
    p.add_argument("--failed", type=int, nargs="+", action="extend", default=[], metavar="N",
                   help="nodes failed before the iteration: their predecessors run their stages")
    p.add_argument("--fail-node", type=int, metavar="N", help="node that dies during the iteration")
    p.add_argument("--fail-before", type=int, metavar="K", help="... before its instruction K")
    p.add_argument("--redundancy", choices=REDUNDANCY, default="eager")
    p.add_argument("--frc", choices=FRC_MODES, default="bubbles",
                   help="eager: FRC only where it fits a wait (bubbles), or for every microbatch (all)")
    p.add_argument("--replica-sync", choices=SYNC_MODES, default="end",
                   help="each replica's sync at the iteration's end, or in the next iteration (next)")
    p.add_argument("--backward-split", choices=SPLITS, default="last",
                   help="each node's last backwards send their input gradients before their weight passes "
                        "(last: as many as the cost model says shorten the iteration), or none (off)")
    p.add_argument("--order", choices=tuple(ORDERS), default="1f1b")
    p.add_argument("--compute-ahead", action="store_true",
                   help="the order bamboo-train --compute-ahead runs: more forwards first, weight passes held back "
                        "(schedules/overlap.py)")
    p.add_argument("--eval", action="store_true", help="the forward-only streams of a validation loss")
    p.add_argument("--forward", type=float, default=1.0, help="cost of one stage forward")
    p.add_argument("--backward", type=float, default=2.0, help="cost of one stage backward")
    p.add_argument("--transfer", type=float, default=0.05, help="message latency")
    p.add_argument("--swap", type=float, default=0.05, help="cost of one swap")
    p.add_argument("--sync-transfer", type=float, default=0.1, help="latency of a replica's sync")


def _build(args):
    if (args.fail_node is None) != (args.fail_before is None):
        raise ScheduleError("--fail-node and --fail-before go together")
    cost = CostModel(forward=args.forward, backward=args.backward, transfer=args.transfer, swap=args.swap,
                     sync_transfer=args.sync_transfer)
    if args.eval:
        if args.fail_node is not None:
            raise ScheduleError("--eval streams have no mid-iteration failure: leave out --fail-node")
        if args.compute_ahead:
            raise ScheduleError("--compute-ahead orders training streams: --eval streams have no backward to order")
        return compile_eval(args.stages, args.microbatches, tuple(args.failed), args.redundancy, cost), cost
    options = ScheduleOptions(redundancy=args.redundancy, order=args.order, frc=args.frc, sync=args.replica_sync,
                              split=args.backward_split, ahead=args.compute_ahead)
    failed = tuple(args.failed)
    if args.fail_node is None:
        return compile_schedule(args.stages, args.microbatches, failed, options, cost), cost
    return compile_recovery(args.stages, args.microbatches, args.fail_node, args.fail_before, failed, options,
                            cost), cost


def _title(schedule) -> str:
    what = f"P={schedule.stages} M={schedule.microbatches} {schedule.order} redundancy={schedule.redundancy}"
    if schedule.redundancy == Redundancy.EAGER:
        what += f" frc={schedule.frc}"
    if schedule.sync != ReplicaSync.END:
        what += f" replica-sync={schedule.sync}"
    if schedule.evaluation:
        what = f"evaluation (forward only) P={schedule.stages} M={schedule.microbatches}"
    if schedule.failed:
        what += f" failed={list(schedule.failed)}"
    if schedule.fail_node is not None:
        what += f" node {schedule.fail_node} dies before instruction {schedule.fail_before}"
    return what


def _dead_marker(schedule, report):
    if schedule.fail_node is None:
        return None
    ends = [s.end for s in report.spans if s.node == schedule.fail_node]
    return (schedule.fail_node, max(ends, default=0.0))


def cmd_dump(args) -> None:
    schedule, _ = _build(args)
    json.dump(schedule.to_json(), sys.stdout)
    sys.stdout.write("\n")


def cmd_simulate(args) -> None:
    schedule, cost = _build(args)
    r = simulate(schedule, cost)
    out = {"makespan": r.makespan, "bubble": r.bubble, "peak_live_activations": r.peak_live,
           "peak_swapped": r.peak_swapped, "instructions": {n: len(s) for n, s in schedule.streams.items()}}
    print(json.dumps(out, indent=1))


def cmd_render(args) -> None:
    schedule, cost = _build(args)
    report = simulate(schedule, cost)
    print(text_view(schedule, report, args.width))
    if not args.no_png:
        from schedules.timing.render import render_png
        render_png(report, args.out, _title(schedule), _dead_marker(schedule, report))
        print(f"wrote {args.out}")


def text_view(schedule, report, width: int = 100) -> str:
    from schedules.timing.render import text_timeline
    return text_timeline(report, width, _title(schedule))


def cmd_demo(args) -> None:
    P, M = args.stages, args.microbatches
    cost = CostModel()
    off = compile_schedule(P, M, options=ScheduleOptions(redundancy="off"), cost=cost)
    eager = compile_schedule(P, M, cost=cost)
    r_off, r_eager = simulate(off, cost), simulate(eager, cost)
    print(text_view(off, r_off), "\n")
    print(text_view(eager, r_eager), "\n")
    victim = P // 2
    fail_before = len(eager.streams[victim]) // 2
    rec = compile_recovery(P, M, victim, fail_before, cost=cost)
    r_rec = simulate(rec, cost)
    print(text_view(rec, r_rec), "\n")
    print(f"iteration time, eager FRC / no redundancy: {r_eager.makespan / r_off.makespan:.3f}")
    print(f"iteration time with node {victim} killed mid-iteration / fault-free eager: "
          f"{r_rec.makespan / r_eager.makespan:.3f}")
    from schedules.timing.render import render_png
    os.makedirs(args.out_dir, exist_ok=True)
    for name, sch, rep in (("no-redundancy", off, r_off), ("eager", eager, r_eager), ("recovery", rec, r_rec)):
        path = os.path.join(args.out_dir, f"schedule-{name}.png")
        render_png(rep, path, _title(sch), _dead_marker(sch, rep))
        print(f"wrote {path}")


def _check_outputs(args) -> None:
    """Where render and demo write, checked before anything is printed."""
    if getattr(args, "width", 1) < 1:
        raise ScheduleError(f"--width must be at least 1 column (got {args.width})")
    if args.command == "render" and not args.no_png:
        folder = os.path.dirname(os.path.abspath(args.out))
        if os.path.isdir(args.out) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ScheduleError(f"--out {args.out!r}: cannot write a PNG there")
    if args.command == "demo" and os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise ScheduleError(f"--out-dir {args.out_dir!r} is a file, not a directory")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m schedules", description="Bamboo's schedule compiler")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("dump", help="print the instruction streams as one JSON object")
    _schedule_args(p)
    p.set_defaults(func=cmd_dump)
    p = sub.add_parser("simulate", help="print makespan, bubbles and memory of the streams")
    _schedule_args(p)
    p.set_defaults(func=cmd_simulate)
    p = sub.add_parser("render", help="print a text timeline and write a PNG")
    _schedule_args(p)
    p.add_argument("--out", default="schedule.png", help="PNG path (default schedule.png)")
    p.add_argument("--no-png", action="store_true", help="text view only")
    p.add_argument("--width", type=int, default=100, help="columns of the text view")
    p.set_defaults(func=cmd_render)
    p = sub.add_parser("demo", help="show fault-free, redundant and recovery schedules")
    p.add_argument("--stages", "-P", type=int, default=4)
    p.add_argument("--microbatches", "-M", type=int, default=8)
    p.add_argument("--out-dir", default="out", help="where the PNGs go (default out/)")
    p.set_defaults(func=cmd_demo)
    args = parser.parse_args(argv)
    try:
        _check_outputs(args)
        args.func(args)
    except ScheduleError as e:
        print(f"python -m schedules: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
