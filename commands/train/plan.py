"""`--plan`: what a layout costs in memory, bubble and network before any node starts.

Each worker (one per GPU) holds its stage and, with eager or lazy redundancy, the
next stage's replica (the first rows below count both), with:

- weights, gradients and AdamW's two moments, in the weights' dtype;
- with agents, the undo copies of each step (its parameters and moments before
  it: bamboo/runtime/steps.py), from the step until the next iteration starts;
- the owner's flattened gradients on their way to the replica's holder, and with
  several pipelines the untouched copy a reduce keeps to retry from;
- the activations of the microbatches whose forward ran and whose backward has
  not, found by walking the node's compiled stream (schedules/), each stage's per
  microbatch measured (bamboo/model/activations.py), and the backward's working
  set (one layer's activations again); eager's FRC forward on the device until
  its swap-out, then in host memory.

The peak is the larger of the compute phase (activations, no undo) and the
iteration's tail (undo copies, no activations). Host memory adds the checkpoint
copies kept in memory (a node's own stage and one it holds for a peer) and a
process's fixed share (`PROCESS_GIB`: interpreter, torch, CUDA libraries).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from schedules.compiler import compile_schedule, simulate
from schedules.cost import CostModel
from schedules.ir import Op
from schedules.options import JobRedundancy, JobReplicaSync, Redundancy

from bamboo.control.config import JobConfig, Precision
from bamboo.model.activations import LayerBytes
from bamboo.model.partition import partition
from commands.train.instances import GIB

CONTEXT_GIB = 0.5   # the CUDA context and allocator reserve on each GPU, not available to tensors
PROCESS_GIB = 3.0   # a worker's host memory before any tensor: interpreter, torch, CUDA libraries


@dataclass(frozen=True)
class Target:
    """Where the plan must fit: a GPU's memory and the host's, per worker."""
    name: str
    gpu_bytes: int | None = None
    host_bytes: int | None = None   # the instance's RAM ...
    workers: int = 1                # ... shared by this many workers


@dataclass
class StageMemory:
    """One worker's bytes on stage `stage`, by what holds them."""
    stage: int
    device: dict = field(default_factory=dict)
    host: dict = field(default_factory=dict)
    compute_peak: int = 0
    tail_peak: int = 0

    @property
    def gpu_total(self) -> int:
        return max(self.compute_peak, self.tail_peak)

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


@dataclass
class Plan:
    stages: list[StageMemory]
    bubble: float                 # idle share of a fault-free iteration (no FRC), mean over the nodes
    tokens: int                   # per iteration
    links: dict                   # what crosses the network per iteration: name -> bytes
    params: int
    per_pipeline: int             # microbatches of the largest pipeline
    time_per_token: float         # the iteration's length in the cost model's units, per token: to compare layouts
    notes: list = field(default_factory=list)

    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda m: m.gpu_total)

    def misfit(self, target: Target) -> str | None:
        """Why this plan does not fit `target` (one line), or None."""
        worst = self.worst()
        if target.gpu_bytes is not None and worst.gpu_total > target.gpu_bytes - CONTEXT_GIB * GIB:
            return (f"stage {worst.stage} needs {worst.gpu_total / GIB:.1f} GiB per GPU, more than {target.name}'s "
                    f"{target.gpu_bytes / GIB:.1f} GiB less {CONTEXT_GIB} GiB for the CUDA context")
        host = max(self.stages, key=lambda m: m.host_total)
        if target.host_bytes is not None and host.host_total * target.workers > target.host_bytes:
            return (f"stage {host.stage}'s worker needs {host.host_total / GIB:.1f} GiB of host memory, times "
                    f"{target.workers} worker(s), more than {target.name}'s {target.host_bytes / GIB:.0f} GiB")
        return None


def stage_costs(costs: list[float], ranges: list[range]) -> list[int]:
    return [int(sum(costs[i] for i in r)) for r in ranges]


def _stream_peaks(stream, own: tuple[int, int], replica: tuple[int, int]) -> tuple[int, int]:
    """The most forward-state bytes resident on the device, and swapped to the
    host, at any point of one node's fault-free stream, in its order (the
    runtime's): `own` = (activations, gradients owed to a weight pass) per
    microbatch of its stage, `replica` = (on the device, once swapped) per FRC forward."""
    device = host = peak_device = peak_host = 0
    for ins in stream:
        if ins.op is Op.FORWARD:
            device += replica[0] if ins.redundant else own[0]
        elif ins.op is Op.BACKWARD:
            device -= own[0]
        elif ins.op is Op.BACKWARD_INPUT:
            device += own[1]
        elif ins.op is Op.BACKWARD_WEIGHT:
            device -= own[0] + own[1]
        elif ins.op is Op.SWAP_OUT:
            device, host = device - replica[0], host + replica[1]
        elif ins.op is Op.SWAP_IN:
            device, host = device + replica[0], host - replica[1]
        peak_device, peak_host = max(peak_device, device), max(peak_host, host)
    return peak_device, peak_host


def _cost_model(params: list[int], tokens: int) -> CostModel:
    """Each stage's forward takes time in proportion to its parameters (what the
    partition balances) times a microbatch's tokens, its backward twice that;
    messages, swaps and steps are left out: the bubble is the pipeline's own."""
    forward = tuple(max(p, 1) * tokens * 1e-9 for p in params)
    return CostModel(forward=forward, backward=tuple(2 * f for f in forward), transfer=0.0, swap=0.0, step=0.0,
                     sync_transfer=0.0)


def _mode(cfg: JobConfig) -> Redundancy:
    """The mode whose memory the plan counts: auto may pick eager, so it is eager's."""
    chosen = cfg.schedule.redundancy
    return Redundancy.EAGER if chosen is JobRedundancy.AUTO else Redundancy(chosen.value)


@dataclass(frozen=True)
class StageBytes:
    """Per stage: parameters, and one microbatch's activations (kept on the device;
    copied to host by an FRC swap-out, with the stage's output)."""
    params: list[int]
    kept: list[int]
    swapped: list[int]
    owed: list[int]      # kept from a split backward's input pass to its weight pass
    working: list[int]   # the backward's working set: the stage's largest layer's activations


def stage_bytes(costs: list[float], layers: list[LayerBytes], ranges: list[range], shape: tuple) -> StageBytes:
    batch, seq = shape
    return StageBytes(stage_costs(costs, ranges),
                      [sum(layers[i].saved(batch, seq) for i in r) for r in ranges],
                      [sum(layers[i].swapped.at(batch, seq) for i in r) + layers[r[-1]].output(batch, seq)
                       for r in ranges],
                      [sum(layers[i].owed.at(batch, seq) for i in r) for r in ranges],
                      [max(layers[i].saved(batch, seq) for i in r) for r in ranges])


def make_plan(cfg: JobConfig, costs: list[float], layers: list[LayerBytes], shape: tuple[int, int]) -> Plan:
    """The plan of `cfg` for a model of per-layer `costs` (parameters) and
    activations `layers`, with `shape` = (nodes, sequence length)."""
    nodes, seq = shape
    width = cfg.model.torch_dtype.itemsize  # bytes per weight, gradient and moment
    sch = cfg.schedule
    P, batch = sch.stages, sch.batch
    pipelines = max(1, nodes // P)
    per_pipeline = math.ceil(sch.microbatches / pipelines)
    ranges = partition(costs, P)
    sizes = stage_bytes(costs, layers, ranges, (batch, seq))
    mode = _mode(cfg)
    keeps = mode is not Redundancy.OFF
    cost = _cost_model(sizes.params, batch * seq)
    streams = compile_schedule(P, per_pipeline, options=cfg.options(mode), cost=cost).streams
    plain = compile_schedule(P, per_pipeline, options=sch.options(Redundancy.LAZY if keeps else mode), cost=cost)
    timed = simulate(plain)
    stages = [_stage_memory(cfg, s, sizes, streams[s], pipelines) for s in range(P)]
    boundary = sum(layers[r[-1]].output(batch, seq) for r in ranges[:-1])
    links = {"activations, forward": sch.microbatches * boundary, "input gradients, back": sch.microbatches * boundary}
    if keeps:
        links["replica syncs"] = pipelines * sum(sizes.params) * width
    if pipelines > 1:
        links["data-parallel reduce"] = 2 * (pipelines - 1) * sum(sizes.params) * width
    notes = [f"{nodes - pipelines * P} node(s) beyond {pipelines} full pipeline(s) are not planned"] \
        if nodes % P else []
    if cfg.schedule.redundancy is JobRedundancy.AUTO:
        notes.append("--redundancy auto is planned as eager, the mode that holds the most")
    if cfg.schedule.replica_sync is JobReplicaSync.AUTO and cfg.cluster.elastic:
        notes.append("--replica-sync auto is planned with the sync at the end, its memory as in the next iteration")
    return Plan(stages, sum(timed.bubble.values()) / len(timed.bubble), sch.microbatches * batch * seq, links,
                int(sum(costs)), per_pipeline, timed.makespan / (sch.microbatches * batch * seq), notes)


def least_gpu_bytes(cfg: JobConfig, costs: list[float], layers: list[LayerBytes], shape: tuple[int, int]) -> int:
    """What the fullest worker needs at the iteration's tail, which holds no
    activations: a bound any plan of `cfg` reaches, found without compiling a stream."""
    nodes, seq = shape
    sizes = stage_bytes(costs, layers, partition(costs, cfg.schedule.stages), (cfg.schedule.batch, seq))
    pipelines = max(1, nodes // cfg.schedule.stages)
    return max(_stage_memory(cfg, s, sizes, [], pipelines).tail_peak for s in range(cfg.schedule.stages))


def _stage_memory(cfg: JobConfig, s: int, sizes: StageBytes, stream, pipelines: int) -> StageMemory:
    """Stage `s`'s worker, its fault-free `stream` walked."""
    width = cfg.model.torch_dtype.itemsize
    P = len(sizes.params)
    replica = (s + 1) % P if _mode(cfg) is not Redundancy.OFF and P > 1 else None
    held = sizes.params[s] + (sizes.params[replica] if replica is not None else 0)
    frc = (sizes.kept[replica], sizes.swapped[replica]) if replica is not None else (0, 0)
    acts, swapped = _stream_peaks(stream, (sizes.kept[s], sizes.owed[s]), frc)
    m = StageMemory(s)
    m.device = {"weights": held * width, "gradients": held * width, "AdamW moments": 2 * held * width,
                "undo copies (agents)": 3 * held * width if cfg.cluster.elastic else 0,
                "sync message": sizes.params[s] * width if replica is not None else 0,
                "reduce copy": sizes.params[s] * width if pipelines > 1 else 0,
                "activations": acts, "backward working set": sizes.working[s]}
    states = 4 * held * width
    late = m.device["sync message"] if cfg.may_sync_late else 0
    m.compute_peak = states + late + acts + sizes.working[s]
    m.tail_peak = states + m.device["undo copies (agents)"] + m.device["sync message"] + m.device["reduce copy"]
    copies = cfg.cluster.elastic and cfg.checkpoints.memory_copies and cfg.checkpoints.checkpoint is not None
    m.host = {"FRC swapped": swapped, "checkpoint copies": 2 * 3 * sizes.params[s] * width if copies else 0,
              "process": int(PROCESS_GIB * GIB)}
    return m
