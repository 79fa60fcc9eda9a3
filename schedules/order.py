"""Pass (a): the compute-only order of one virtual stage, as (kind, microbatch) pairs.

`kind` is "F" or "B". Virtual stage v of V runs forwards and backwards of its
stages; the two classic orders are GPipe (all forwards, then all backwards) and
1F1B (PipeDream-flush: a warm-up of V-v-1 forwards, then one forward and one
backward alternately, then the remaining backwards). 1F1B keeps at most V-v
microbatches alive on a stage; GPipe keeps all M. `extra` lengthens 1F1B's warm-up
on every stage but the last (schedules/overlap.py: forwards that overlap the
iteration before's tail, each one more microbatch alive).
"""
from __future__ import annotations

Step = tuple[str, int]


def gpipe(num_virtual: int, microbatches: int, v: int, extra: int = 0) -> list[Step]:
    return [("F", mb) for mb in range(microbatches)] + [("B", mb) for mb in range(microbatches)]


def one_f_one_b(num_virtual: int, microbatches: int, v: int, extra: int = 0) -> list[Step]:
    warmup = min(num_virtual - v - 1 + (extra if v < num_virtual - 1 else 0), microbatches)
    order: list[Step] = [("F", mb) for mb in range(warmup)]
    fwd, bwd = warmup, 0
    while bwd < microbatches:
        if fwd < microbatches:
            order.append(("F", fwd))
            fwd += 1
        order.append(("B", bwd))
        bwd += 1
    return order


ORDERS = {"1f1b": one_f_one_b, "gpipe": gpipe}
