"""The simulator's profile of a user's own job: the model bamboo-train would build
(a built-in, an `hf:` shape, a `--model-config`), counted on the meta device, on
the GPU of an instance type, with the network bytes its plan counts
(commands/train/plan.py, checked against what the runtime sends)."""
from __future__ import annotations

from dataclasses import dataclass

from bamboo.control.config import JobConfig
from sim.profiles import GPU_UTILISATION, Profile


@dataclass(frozen=True)
class JobModel:
    profile: Profile
    links: dict[str, float]     # bytes over the network per fault-free iteration, by kind, at the full layout
    checkpoint_bytes: float     # one complete checkpoint: weights and AdamW's two moments
    tokens_per_sample: int      # the sequence length

    def describe(self) -> dict:
        """The job as the simulator sees it, for the JSON output."""
        p = self.profile
        return {"model": p.name, "parameters": int(p.layer_params * p.layers), "layers": p.layers, "hidden": p.hidden,
                "seq": p.seq, "batch": p.microbatch, "microbatches": p.microbatches, "gpu_flops_sustained": p.gpu_flops,
                "gpu_utilisation": GPU_UTILISATION, "checkpoint_bytes": int(self.checkpoint_bytes),
                "network_bytes_per_iteration": {k: int(v) for k, v in self.links.items()}}


def _shape(config) -> tuple[int, int]:
    """(hidden size, attention blocks) of a Hugging Face or built-in config; (0, 0)
    for a factory model (no attention term)."""
    for hidden, blocks in (("hidden_size", "num_hidden_layers"), ("n_embd", "n_layer"), ("dim", "layers")):
        if hasattr(config, hidden) and hasattr(config, blocks):
            return int(getattr(config, hidden)), int(getattr(config, blocks))
    return 0, 0


def job_model(cfg: JobConfig, nodes: int, peak_flops: float) -> JobModel:
    """`cfg`'s model on `nodes` nodes of GPUs of `peak_flops`, run at the profile's
    sustained share of it."""
    from commands.train.plan import make_plan   # torch: only for a user's model
    from commands.train.plan_report import measure
    source, costs, measured = measure(cfg)
    plan = make_plan(cfg, costs, measured, (nodes, source.seq))
    hidden, blocks = _shape(getattr(source, "config", None))
    sch = cfg.schedule
    profile = Profile(cfg.model.name, layers=source.count, hidden=hidden, seq=source.seq, microbatch=sch.batch,
                      microbatches=sch.microbatches, params=sum(costs), blocks=blocks,
                      gpu_flops=peak_flops * GPU_UTILISATION)
    width = cfg.model.torch_dtype.itemsize
    return JobModel(profile, dict(plan.links), 3 * sum(costs) * width, source.seq)
