"""A training job's settings, shared by the launcher, every worker and the reference.

`JobConfig` is one typed section per group of bamboo-train's flags (model, schedule,
recipe, data, checkpoints, faults, devices, cluster, testing: the groups of
commands/train/flags.py's GROUPS, which also name a job file's TOML sections). A
section's field has its flag's name, unless `DERIVED` says how it is made; every
choice is a str enum. The whole value goes to etcd as JSON and back, each field's
type checked on the way in.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING

from schedules.options import (BackwardSplit, Choice, Frc, JobRedundancy, JobReplicaSync, Redundancy, ReplicaSync,
                               ScheduleOptions, make_members)
from bamboo.control.records import BadRecord, checked

if TYPE_CHECKING:  # for the annotation only: torch is imported where tensors are made
    import torch

DTYPES = ("float32", "float64")  # torch's dtypes of those names (imported only where tensors are made)


class Precision(Choice):
    """--precision: float32 throughout, or bf16/fp16 autocast over float32 weights."""
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


class LrSchedule(Choice):
    """--lr-schedule: the learning rate after the warm-up."""
    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


class Surplus(Choice):
    """--surplus: the nodes beyond the pipelines (agents/surplus.py's rules)."""
    BURST = "burst"        # the burst model's count, each standby kept while it earns its price; the rest released
    BINOMIAL = "binomial"  # ByteRobust: a binomial quantile of independent faults
    FIXED = "fixed"        # SpotHedge: a fixed number of extra nodes
    KEEP = "keep"          # every node the cloud grants is kept (no release)


class ZoneSpread(Choice):
    """--zone-spread: neighbouring stages in different zones, or each pipeline in as few zones as it can."""
    SPREAD = "spread"  # a zone's burst takes no node with its replica's holder; boundaries cross zones (billed)
    PACK = "pack"      # only the data-parallel reduce crosses a zone (agents/spread.py weighs the two)


class Transport(Choice):
    """--transport: the workers' payloads over gloo, or NCCL (a GPU per worker); auto is gloo."""
    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"


@dataclass(frozen=True)
class Preempt:
    """SIGKILL node `node` just before instruction `instruction` of `iteration`'s
    training stream, or (phase "eval") of its evaluation stream after the step."""
    node: int
    iteration: int
    instruction: int = 0
    phase: str = "train"

    def fires(self, node: int, iteration: int, instruction: int, phase: str) -> bool:
        return (self.node, self.iteration, self.instruction, self.phase) == (node, iteration, instruction, phase)


class Section:
    """A typed group of settings: str values of its enum fields are made members,
    and a stored one is read back with each field's type checked (BadRecord)."""

    def __post_init__(self):
        make_members(self, _ENUMS, lambda name, kind, value: BadRecord(
            f"{name} must be one of {', '.join(kind.values())} (got {value!r})"))

    @classmethod
    def from_dict(cls, d):
        return cls(**_tuples(checked(cls, d)))


@dataclass(frozen=True)
class ModelSpec(Section):
    name: str = "tiny"             # --model: a built-in, hf:NAME, hf:config or a factory module:function
    config_json: str | None = None  # a Hugging Face config.json's text (--model-config)
    seq: int = 32                  # tokens per sequence, for factory models (built-ins fix their own)
    seed: int = 0
    dtype: str = "float32"         # of the weights and optimizer state
    layers: int = 0                # the model's layer count (what a complete checkpoint holds)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch  # here, so that commands that never make a tensor start without it
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class ScheduleSpec(Section):
    stages: int = 2
    pipelines: int = 1
    microbatches: int = 4
    iterations: int = 10
    batch: int = 2                 # sequences per microbatch
    redundancy: JobRedundancy = JobRedundancy.EAGER
    frc: Frc = Frc.BUBBLES         # eager: FRC only where it fits the bubbles, or for every microbatch
    sync_bucket_mb: float = 4.0    # a replica's sync posted in buckets this large (bamboo/runtime/sync.py)
    replica_sync: JobReplicaSync = JobReplicaSync.AUTO  # at the iteration's end, in the next one (schedules/syncs.py),
                                                        # or chosen per epoch by the agents (auto; without them: end)
    backward_split: BackwardSplit = BackwardSplit.LAST  # the last backwards send input gradients first
    auto_prior_rate: float = 0.05  # --redundancy auto: deaths per node-hour assumed before any are seen ...
    auto_prior_hours: float = 2.0  # ... weighing as much as this many node-hours of observation
    max_stages_per_node: int = 2   # agents: nodes left over from full pipelines form shorter ones (1: standby)

    @property
    def nodes(self) -> int:
        return self.stages * self.pipelines

    @property
    def samples(self) -> int:
        """Sequences per iteration: every microbatch's batch."""
        return self.microbatches * self.batch

    @property
    def fixed_sync(self) -> ReplicaSync:
        """The sync every epoch runs, where the job fixes it (with auto, before the
        agents choose: at the end)."""
        return ReplicaSync.END if self.replica_sync == JobReplicaSync.AUTO else ReplicaSync(self.replica_sync)

    def epoch_sync(self, epoch) -> ReplicaSync:
        """The replica sync `epoch` (an Assignment) runs: the agents' choice, else the
        job's; at the end without replicas (off)."""
        if epoch.mode(self.redundancy) == Redundancy.OFF:
            return ReplicaSync.END
        return ReplicaSync(epoch.sync) if epoch.sync else self.fixed_sync

    def late_in(self, epoch) -> bool:
        """Whether `epoch`'s replicas take their syncs in the next iteration: the one
        test the executor, the handover and the agents read."""
        return self.epoch_sync(epoch) is ReplicaSync.NEXT

    @property
    def chooses(self) -> bool:
        """Whether the agents choose something per epoch: the mode (--redundancy
        auto) or the sync (--replica-sync auto)."""
        return self.redundancy == JobRedundancy.AUTO or self.replica_sync == JobReplicaSync.AUTO

    def options(self, redundancy: Redundancy | str, sync: ReplicaSync | str | None = None) -> ScheduleOptions:
        """The compiler's options for a stream run in `redundancy` (auto's pick of the
        epoch) with `sync` (the epoch's; default: the job's fixed one)."""
        return ScheduleOptions(redundancy=redundancy, frc=self.frc, sync=sync or self.fixed_sync,
                               split=self.backward_split)


@dataclass(frozen=True)
class RecipeSpec(Section):
    lr: float = 1e-3
    min_lr: float = 0.0            # where a linear or cosine schedule ends
    lr_schedule: LrSchedule = LrSchedule.CONSTANT  # after the warm-up (bamboo/model/recipe.py)
    warmup: int = 0                # iterations of linear warm-up
    weight_decay: float = 0.01     # AdamW's decoupled decay, on weights of 2+ dimensions
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 0.0         # clip the global gradient norm to this (0: never)
    precision: Precision = Precision.FP32  # autocast over float32 weights (bamboo/model/builtin.py)
    initial_loss_scale: float = 65536.0  # fp16: the dynamic loss scale's first value ...
    loss_scale_window: int = 1000        # ... doubled after this many steps in a row without an overflow ...
    min_loss_scale: float = 1.0          # ... halved after one, never below this

    @property
    def loss_scaling(self) -> bool:
        """fp16 scales its loss dynamically (bamboo/model/recipe.py, protocol.LossScale)."""
        return self.precision is Precision.FP16


@dataclass(frozen=True)
class DataSpec(Section):
    data_files: tuple[str, ...] = ()  # --data: text files, or one token file (.bin)
    token_dtype: str = "uint16"    # of a token file's ids (bamboo/data/corpus.py)
    val_fraction: float = 0.05     # the tail of the token stream held out for validation ...
    val_files: tuple[str, ...] = ()  # ... unless validation has files of its own (--val-data)
    eval_every: int = 0            # validation loss after every K-th iteration (and the last); 0: never
    eval_batches: int = 8          # validation microbatches per evaluation (fixed, global)


@dataclass(frozen=True)
class CheckpointSpec(Section):
    checkpoint: str | None = None  # a directory or s3://bucket/prefix or gs://bucket/prefix
    checkpoint_every: int = 0      # iterations between checkpoints (0: never)
    checkpoint_seconds: float = 0  # seconds between checkpoints (0: never)
    checkpoint_keep: int = 0       # committed checkpoints kept in storage, the newest (0: every one)
    run: str = "run"               # this run's name in its checkpoints' folders (a resume is another run)
    resume: bool = False           # start from the newest complete checkpoint
    memory_copies: bool = True     # checkpoints kept in peers' memory too: a rollback reads no storage
    save_dir: str | None = None    # final parameters, one file per layer


@dataclass(frozen=True)
class FaultSpec(Section):
    failure_timeout: float = 3.0   # a node whose lease went unrefreshed this long is dead
    lease_ttl: float = 15.0        # etcd lease TTL: how long etcd may be away before keys vanish
    hang_timeout: float = 300.0    # a main thread stuck this long lets its lease lapse; gloo's op timeout
    straggler_factor: float = 5.0  # compute this many times the peers' median (0: never) ...
    straggler_slack: float = 3.0   # ... and this many seconds more: the node is a straggler, fenced
    stall_timeout: float = 1800.0  # the launcher gives up when no iteration ends for this long


@dataclass(frozen=True)
class DeviceSpec(Section):
    names: tuple[str, ...] = ()    # --devices: GPUs of a host's workers, or ("cpu",) (bamboo/transport/devices.py)
    share_gpu: bool = False        # more workers than GPUs on a host share them
    transport: Transport = Transport.AUTO  # gloo, or nccl (a GPU per worker: bamboo/transport/channels.py)


@dataclass(frozen=True)
class ClusterSpec(Section):
    job: str = "job"
    elastic: bool = False          # agents decide the configuration (else P x D fixed nodes)
    last_call: float = 10.0        # agents: once one pipeline's nodes met, the first configuration waits this long
    surplus: Surplus = Surplus.BURST  # agents: nodes in no pipeline released but for a burst-sized standby, or kept
    acquire_seconds: float = 300.0  # a node asked for comes this long after (the burst rule's window)
    standby_epsilon: float = 0.01  # the burst rule: the chance of losing more than the standby within that window
    fixed_standby: int = 2         # --surplus fixed: the standby kept
    zone_spread: ZoneSpread = ZoneSpread.SPREAD  # agents: new pipelines' zones spread, or packed (agents/policy.py)


@dataclass(frozen=True)
class TestingSpec(Section):
    preempt: tuple[Preempt, ...] = ()  # kills at chosen instructions
    check_replicas: bool = False   # digest owners and replicas after every step
    compute_ahead: bool = False    # stage 0's next forwards run while it waits (bamboo/runtime/ahead.py)

    @classmethod
    def from_dict(cls, d):
        kept = checked(cls, d)
        if "preempt" in kept:
            try:
                kept["preempt"] = tuple(Preempt(**checked(Preempt, p)) for p in kept["preempt"])
            except TypeError as e:
                raise BadRecord(f"a preempt record is incomplete: {e}") from None
        return cls(**_tuples(kept))


# A section field made otherwise than from its flag's value: how (commands/train/cli.py).
DERIVED = {"name": "--model, or hf:config with --model-config", "config_json": "--model-config's text",
           "layers": "the model's layer count", "data_files": "--data", "val_files": "--val-data",
           "run": "a fresh name per run", "memory_copies": "not --no-memory-copies", "names": "--devices, parsed",
           "job": "--job, or job", "elastic": "--local-nodes given", "preempt": "--preempt, parsed"}
_ENUMS = {"redundancy": JobRedundancy, "frc": Frc, "replica_sync": JobReplicaSync, "backward_split": BackwardSplit,
          "lr_schedule": LrSchedule, "precision": Precision, "transport": Transport, "surplus": Surplus,
          "zone_spread": ZoneSpread}


def _tuples(kept: dict) -> dict:
    """JSON lists back into the tuples the section's fields hold."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in kept.items()}


@dataclass(frozen=True)
class JobConfig:
    model: ModelSpec = field(default_factory=ModelSpec)
    schedule: ScheduleSpec = field(default_factory=ScheduleSpec)
    recipe: RecipeSpec = field(default_factory=RecipeSpec)
    data: DataSpec = field(default_factory=DataSpec)
    checkpoints: CheckpointSpec = field(default_factory=CheckpointSpec)
    faults: FaultSpec = field(default_factory=FaultSpec)
    devices: DeviceSpec = field(default_factory=DeviceSpec)
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    testing: TestingSpec = field(default_factory=TestingSpec)

    @classmethod
    def of(cls, **settings) -> JobConfig:
        """A config from settings named by field, whatever their section (tests and
        tools that set a few); a name no section has is a TypeError."""
        return cls().with_(**settings)

    def with_(self, **settings) -> JobConfig:
        """This config with the named fields changed, each in its own section."""
        changes: dict[str, dict] = {}
        for name, value in settings.items():
            if name not in _SECTION_OF:
                raise TypeError(f"JobConfig has no setting {name!r}")
            changes.setdefault(_SECTION_OF[name], {})[name] = value
        return replace(self, **{s: replace(getattr(self, s), **c) for s, c in changes.items()})

    @property
    def agents_choose(self) -> bool:
        """Whether agents choose the mode or the sync per epoch: the job leaves one to
        them (ScheduleSpec.chooses) and has agents; without, its fixed ones run."""
        return self.schedule.chooses and self.cluster.elastic

    @property
    def may_sync_late(self) -> bool:
        """Whether some epoch may take its syncs in the next iteration (next, or auto
        where agents choose), with replicas to sync: what memory plans for."""
        s = self.schedule
        late = s.replica_sync == JobReplicaSync.NEXT or (s.replica_sync == JobReplicaSync.AUTO and self.cluster.elastic)
        return late and s.redundancy != JobRedundancy.OFF

    def options(self, redundancy: Redundancy | str, sync: ReplicaSync | str | None = None) -> ScheduleOptions:
        """The compiler's options for the job's streams (ScheduleSpec.options), with
        the order compute ahead overlaps when it is on (schedules/overlap.py)."""
        return self.schedule.options(redundancy, sync).with_(ahead=self.testing.compute_ahead)

    def evaluates(self, iteration: int) -> bool:
        """Whether the validation loss is computed after `iteration`'s step."""
        return evaluated(iteration, self.data.eval_every, self.schedule.iterations)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d) -> JobConfig:
        """The config stored as `d`, each section's fields' types checked (BadRecord)."""
        if not isinstance(d, dict):
            raise BadRecord(f"a JobConfig record is {type(d).__name__}, not a JSON object")
        if unknown := sorted(set(d) - set(_SECTIONS)):  # a flat record of an older version, say
            raise BadRecord(f"a JobConfig record has keys that are no section: {', '.join(unknown)[:80]}")
        return cls(**{f.name: _SECTIONS[f.name].from_dict(d.get(f.name, {})) for f in fields(cls)})


_SECTIONS = {f.name: f.default_factory for f in fields(JobConfig)}
_SECTION_OF = {g.name: s for s, kind in _SECTIONS.items() for g in fields(kind)}
assert len(_SECTION_OF) == sum(len(fields(kind)) for kind in _SECTIONS.values()), "a field name in two sections"


def evaluated(iteration: int, every: int, iterations: int) -> bool:
    """After every `every`-th iteration's step, and after the last (0: never)."""
    return every > 0 and ((iteration + 1) % every == 0 or iteration == iterations - 1)


def dropout_seed_for(seed: int, iteration: int, microbatch: int) -> int:
    """The dropout seed of global microbatch `microbatch` in `iteration`."""
    return (seed * 1_000_003 + iteration) * 100_003 + microbatch
