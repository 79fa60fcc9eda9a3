"""The layers one node holds, and the stages and optimizers built from them.

A node on stage s of a pipeline of depth P holds the layers of stage s and, with
redundancy, of stage (s + 1) mod P (`schedules.layout.Layout.held`); a node on two
stages of a short pipeline holds those two (`Assignment.stages_of`). Layers it
already holds are kept across configurations, with their AdamW state; the others
are built from (seed, layer) or restored from what a handover or a checkpoint
brought.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from typing import NamedTuple

import torch

from bamboo.control.assignment import Assignment
from bamboo.model import recipe
from bamboo.model.api import ModelSource
from bamboo.model.builtin import Stage
from bamboo.model.partition import partition
from bamboo.state.checkpoint import restore, snapshot


class Stages(NamedTuple):
    """What an executor runs: the stages a node holds (stage -> module), their
    optimizers, and per tied weight its stages and this node's copies."""
    modules: dict
    optimizers: dict
    tied: list = []


class Holdings:
    def __init__(self, source: ModelSource, cfg, device: torch.device):
        self.source, self.cfg, self.device = source, cfg, device
        self.layers: dict[int, torch.nn.Module] = {}      # layer index -> module, every layer held
        self.modules: dict[int, Stage] = {}               # stage -> its module, for the stages held
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.ranges: list[range] = []                     # stage -> its layer indexes, at the current depth
        self._partitions: dict[int, list[range]] = {}     # depth -> stage ranges (a partition is not free)
        self._bounds: dict[int, int] = {}                 # layer index -> the most bytes its snapshot may take

    def blob_bound(self, layer: int) -> int:
        """The most bytes a snapshot of `layer` may take: 20 a parameter (its value,
        an fp32 master copy and the optimizer's two fp32 moments take at most 14)
        and a MiB for the rest. A peer that announces more is refused before
        anything is allocated. Sized on the meta device: nothing is built."""
        if layer not in self._bounds:
            with torch.device("meta"):
                module = self.source.layer(layer)
            self._bounds[layer] = 20 * sum(p.numel() for p in module.parameters()) + (1 << 20)
        return self._bounds[layer]

    def mode(self, assignment: Assignment) -> str:
        """The redundancy mode of `assignment` (it may change between epochs)."""
        return assignment.mode(self.cfg.schedule.redundancy)

    def ranges_at(self, depth: int) -> list[range]:
        """Stage -> its layer indexes, for a pipeline of `depth` stages."""
        if depth not in self._partitions:
            self._partitions[depth] = partition(self.source.costs(), depth)
        return self._partitions[depth]

    def layers_of(self, depth: int, stages) -> set[int]:
        ranges = self.ranges_at(depth)
        return {i for s in stages for i in ranges[s]}

    def needs(self, assignment: Assignment, node: int) -> set[int]:
        """Layer indexes `node` holds in `assignment`."""
        return self.layers_of(assignment.depth, assignment.stages_of(node, self.mode(assignment)))

    def drop(self) -> None:
        """Forget every layer and its optimizer state: the next build starts afresh."""
        self.layers, self.modules, self.optimizers = {}, {}, {}

    def build(self, assignment: Assignment, node: int, received: dict[int, bytes]) -> None:
        """The stages `node` holds in `assignment`, from the layers kept (with their
        optimizer state) and those `received` (layer -> snapshot bytes)."""
        P = assignment.depth
        self.ranges = self.ranges_at(P)
        held = assignment.stages_of(node, self.mode(assignment))
        old_state = {p: st for opt in self.optimizers.values() for p, st in opt.state.items()}
        layers = {i: self.layers[i] if i in self.layers else self.source.layer(i).to(self.device)
                  for s in held for i in self.ranges[s]}
        self.modules = {s: Stage([layers[i] for i in self.ranges[s]], self.source.loss if s == P - 1 else None,
                                 self.ranges[s].start) for s in held}
        self.optimizers = {s: recipe.optimizer(m, self.cfg.recipe) for s, m in self.modules.items()}
        self.layers = layers
        for s, opt in self.optimizers.items():
            for p in self.modules[s].parameters():
                if p in old_state:
                    opt.state[p] = old_state[p]
        for i, blob in received.items():
            restore(blob, layers[i], self.optimizer_of(i))

    def stages(self) -> Stages:
        return Stages(self.modules, self.optimizers, self.tied())

    def tied(self) -> list[tuple[tuple[int, ...], dict[int, torch.nn.Parameter]]]:
        """For each tied weight of the model: the stages with a copy, and stage ->
        this node's copy, for the stages it holds."""
        out = []
        for pair in self.source.ties:
            stages, copies = [], {}
            for layer, name in (pair[:2], pair[2:]):
                stage = next(s for s, r in enumerate(self.ranges) if layer in r)
                stages.append(stage)
                if stage in self.modules:
                    copies[stage] = self.layers[layer].get_parameter(name)
            out.append((tuple(stages), copies))
        return out

    def optimizer_of(self, layer: int) -> torch.optim.Optimizer:
        return self.optimizers[next(s for s in self.modules if layer in self.ranges[s])]

    def snapshot(self, stages) -> dict[int, bytes]:
        """Parameters and optimizer state of every layer of `stages`, by layer."""
        blobs = {}
        for s in stages:
            blobs.update(snapshot(dict(zip(self.ranges[s], self.modules[s].layers)), self.optimizers[s]))
        return blobs

    def digests(self) -> dict[str, str]:
        return {str(s): digest(m, self.optimizers[s]) for s, m in self.modules.items()}

    def save(self, stages, directory: str) -> None:
        """The parameters of every layer of `stages`, one file per layer."""
        os.makedirs(directory, exist_ok=True)
        for s in stages:
            for layer, index in zip(self.modules[s].layers, self.ranges[s]):
                save_layer(layer, os.path.join(directory, f"layer{index}.pt"))


def digest(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
        for v in optimizer.state.get(p, {}).values():
            h.update(v.detach().cpu().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode())
    return h.hexdigest()[:16]


def save_layer(module: torch.nn.Module, path: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    os.close(fd)
    torch.save(module.state_dict(), tmp)
    os.replace(tmp, path)
