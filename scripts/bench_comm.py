"""Message latency: Bamboo's channels (bamboo/transport/comm.py) against plain gloo sends.

Two processes ping-pong one tensor (the hot-path GPT's activation by default:
8 x 128 x 256 float32, 1 MiB) over one gloo group on this machine:

- gloo: the main thread sends and receives, blocking, shapes known ahead (what
  DeepSpeed's and torch's pipelines do once shapes are exchanged);
- bamboo: `Comm.post` (header and payload handed to gloo by the caller; the outbox
  thread learns the outcome) and `Comm.recv` (the mailbox thread posted the header's
  and the payload's receives together, and hands the payload over).

It prints the one-way time per message of each (half the round trip, median of
`--rounds` runs of `--messages` round trips) and the difference: what each message
on the 1F1B critical path costs Bamboo more (docs/HOTPATH.md).

    python scripts/bench_comm.py [--messages 400] [--rounds 5] [--shape 8,128,256]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from schedules.ir import Op

from bamboo.transport.comm import Comm


def pingpong(rank: int, port: int, shape: tuple, messages: int, rounds: int, out) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
    other, tensor = 1 - rank, torch.randn(shape)
    comm = Comm(pg, {0: 0, 1: 1}, torch.device("cpu"))
    times: dict[str, list[float]] = {"gloo": [], "bamboo": []}
    received = 0
    for _ in range(rounds):
        for system in times:
            began = time.perf_counter()
            for _ in range(messages):
                if system == "gloo":
                    if rank == 0:
                        pg.send([tensor], other, 9).wait()
                        pg.recv([tensor], other, 9).wait()
                    else:
                        pg.recv([tensor], other, 9).wait()
                        pg.send([tensor], other, 9).wait()
                else:
                    received += 1
                    comm.expect(other, Op.SEND_ACT, received)
                    if rank == 0:
                        comm.post(other, Op.SEND_ACT, tensor)
                        tensor = comm.recv(other, Op.SEND_ACT)
                    else:
                        tensor = comm.recv(other, Op.SEND_ACT)
                        comm.post(other, Op.SEND_ACT, tensor)
            comm.flush(lambda peer: False)
            times[system].append((time.perf_counter() - began) / messages / 2)
    if rank == 0:
        out.put(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=400, help="round trips per run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shape", default="8,128,256")
    a = ap.parse_args()
    try:
        shape = tuple(int(x) for x in a.shape.split(","))
    except ValueError:
        ap.error(f"--shape takes sizes like 8,128,256 (got {a.shape!r})")
    if min(shape) < 1:
        ap.error(f"--shape: every size must be at least 1 (got {a.shape!r})")
    if a.messages < 1 or a.rounds < 1:
        ap.error("--messages and --rounds must be at least 1")
    from bamboo.control.etcd import free_port
    ctx, port = mp.get_context("spawn"), free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=pingpong, args=(r, port, shape, a.messages, a.rounds, out)) for r in range(2)]
    for p in procs:
        p.start()
    times = out.get(timeout=600)
    for p in procs:
        p.join()
    mib = torch.Size(shape).numel() * 4 / 2**20
    print(f"one tensor of shape {shape} float32 ({mib:.2f} MiB), {a.messages} round trips x {a.rounds} runs "
          f"alternated, 2 processes, gloo on 127.0.0.1, 1 torch thread each")
    t = {s: statistics.median(v) for s, v in times.items()}
    for s, v in times.items():
        print(f"  {s:7} one way {t[s] * 1e6:8.1f} us   per run: " + " ".join(f"{x * 1e6:.1f}" for x in v))
    print(f"bamboo - gloo: {(t['bamboo'] - t['gloo']) * 1e6:.1f} us per message; "
          f"bamboo / gloo {t['bamboo'] / t['gloo']:.2f}")


if __name__ == "__main__":
    main()
