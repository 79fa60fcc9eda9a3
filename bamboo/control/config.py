"""A training job's settings, shared by the launcher, every worker and the reference."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from schedules.options import Redundancy, ReplicaSync
from bamboo.control.records import checked

DTYPES = {"float32": torch.float32, "float64": torch.float64}


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


@dataclass(frozen=True)
class JobConfig:
    model: str = "tiny"
    model_config: str | None = None  # a Hugging Face config.json's text (--model-config)
    stages: int = 2
    pipelines: int = 1
    microbatches: int = 4
    iterations: int = 10
    redundancy: str = "eager"
    frc: str = "bubbles"           # eager: FRC only where it fits the bubbles, or for every microbatch (all)
    sync_bucket_mb: float = 4.0    # a replica's sync posted in buckets this large (bamboo/runtime/sync.py)
    compute_ahead: bool = False    # stage 0's next forward run while the boundary agrees (bamboo/runtime/ahead.py)
    replica_sync: str = "end"      # a replica's sync at the iteration's end, or in the next one (schedules/syncs.py)
    backward_split: str = "last"   # each node's last backward sends its input gradient first (schedules/early_grads.py)
    auto_prior_rate: float = 0.05  # --redundancy auto: deaths per node-hour assumed before any are seen ...
    auto_prior_hours: float = 2.0  # ... weighing as much as this many node-hours of observation
    max_stages_per_node: int = 2   # agents: nodes left over from full pipelines form shorter ones (1: standby)
    seed: int = 0
    batch: int = 2              # sequences per microbatch
    seq: int = 32               # tokens per sequence, for factory models (built-ins fix their own)
    lr: float = 1e-3
    min_lr: float = 0.0            # where --lr-schedule linear/cosine ends
    lr_schedule: str = "constant"  # after --warmup: constant, linear or cosine (bamboo/model/recipe.py)
    warmup: int = 0                # iterations of linear warm-up
    weight_decay: float = 0.01     # AdamW's decoupled decay, on weights of 2+ dimensions
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 0.0         # clip the global gradient norm to this (0: never)
    dtype: str = "float32"
    precision: str = "fp32"        # fp32, or bf16/fp16 autocast over float32 weights (bamboo/model/builtin.py)
    initial_loss_scale: float = 65536.0  # fp16: the dynamic loss scale's first value ...
    loss_scale_window: int = 1000        # ... doubled after this many steps in a row without an overflow ...
    min_loss_scale: float = 1.0          # ... halved after one, never below this
    failure_timeout: float = 3.0  # a node whose lease went unrefreshed this long is dead
    lease_ttl: float = 15.0       # etcd lease TTL: how long etcd may be away before keys vanish
    hang_timeout: float = 300.0   # a main thread stuck this long lets its lease lapse; gloo's op timeout
    straggler_factor: float = 5.0  # compute this many times the peers' median (0: never) ...
    straggler_slack: float = 3.0   # ... and this many seconds more: the node is a straggler, fenced
    stall_timeout: float = 1800.0  # the launcher gives up when no iteration ends for this long
    last_call: float = 10.0        # agents: once one pipeline's nodes met, the first configuration waits this long
    preempt: tuple[Preempt, ...] = field(default_factory=tuple)
    data_files: tuple[str, ...] = field(default_factory=tuple)  # text files, or one token file (.bin)
    token_dtype: str = "uint16"    # of a token file's ids (bamboo/data/corpus.py)
    val_fraction: float = 0.05     # the tail of the token stream held out for validation ...
    val_files: tuple[str, ...] = field(default_factory=tuple)  # ... unless validation has files of its own
    eval_every: int = 0            # validation loss after every K-th iteration (and the last); 0: never
    eval_batches: int = 8          # validation microbatches per evaluation (fixed, global)
    save_dir: str | None = None   # final parameters, one file per layer
    checkpoint: str | None = None  # a directory or s3://bucket/prefix
    checkpoint_every: int = 0      # iterations between checkpoints (0: never)
    checkpoint_seconds: float = 0  # seconds between checkpoints (0: never)
    checkpoint_keep: int = 0       # committed checkpoints kept in storage, the newest (0: every one)
    run: str = "run"               # this run's name in its checkpoints' folders (a resume is another run)
    resume: bool = False           # start from the newest complete checkpoint
    memory_copies: bool = True     # checkpoints kept in peers' memory too: a rollback reads no storage
    check_replicas: bool = False  # digest owners and replicas after every step
    devices: tuple[str, ...] = field(default_factory=tuple)  # GPUs of a host's workers, or ("cpu",) (devices.py)
    share_gpu: bool = False        # more workers than GPUs on a host share them
    transport: str = "auto"        # gloo, or nccl (a GPU per worker: bamboo/transport/channels.py); auto is gloo
    elastic: bool = False          # agents decide the configuration (else P x D fixed nodes)
    layers: int = 0                # the model's layer count (what a complete checkpoint holds)
    job: str = "job"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def nodes(self) -> int:
        return self.stages * self.pipelines

    @property
    def late_sync(self) -> bool:
        """--replica-sync next with replicas to sync (not --redundancy off): the one
        test the executor, the handover and the agents read."""
        return self.replica_sync == ReplicaSync.NEXT and self.redundancy != Redundancy.OFF

    @property
    def loss_scaling(self) -> bool:
        """fp16 scales its loss dynamically (bamboo/model/recipe.py, protocol.LossScale)."""
        return self.precision == "fp16"

    def evaluates(self, iteration: int) -> bool:
        """Whether the validation loss is computed after `iteration`'s step."""
        return evaluated(iteration, self.eval_every, self.iterations)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "JobConfig":
        """The config stored as `d`, each field's type checked (BadRecord)."""
        d = dict(checked(cls, d), preempt=tuple(Preempt(**p) for p in d["preempt"]), data_files=tuple(d["data_files"]),
                 val_files=tuple(d.get("val_files", ())),
                 devices=tuple(d.get("devices", ())),
                 betas=tuple(d["betas"]))
        return cls(**d)


def evaluated(iteration: int, every: int, iterations: int) -> bool:
    """After every `every`-th iteration's step, and after the last (0: never)."""
    return every > 0 and ((iteration + 1) % every == 0 or iteration == iterations - 1)


def dropout_seed_for(seed: int, iteration: int, microbatch: int) -> int:
    """The dropout seed of global microbatch `microbatch` in `iteration`."""
    return (seed * 1_000_003 + iteration) * 100_003 + microbatch
