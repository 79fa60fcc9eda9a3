"""Checkpoints of a worker: per layer (so a resume may use another depth), atomic,
written in the background. The files, their storage and when one is complete are
bamboo/data/checkpoint_files.py's.
"""
from __future__ import annotations

import io
import pickle
import sys
import threading
import time
from dataclasses import asdict

import torch

from bamboo.data.checkpoint_files import (Attempt, CheckpointError, latest, layer_hashes, load, stored_extra,
                                          storage_for, write_part)


def snapshot(layers: dict[int, torch.nn.Module], optimizer: torch.optim.Optimizer) -> dict[int, bytes]:
    """Serialise layers (index -> module) with their AdamW state, now, into memory."""
    out = {}
    for index, layer in layers.items():
        optim = {name: {k: (v.detach().cpu().clone() if torch.is_tensor(v) else v)
                        for k, v in optimizer.state.get(p, {}).items()}
                 for name, p in layer.named_parameters()}
        buf = io.BytesIO()
        torch.save({"params": {k: v.detach().cpu().clone() for k, v in layer.state_dict().items()},
                    "optim": optim}, buf)
        out[index] = buf.getvalue()
    return out


class Writer:
    """Writes snapshots in a background thread, one at a time, so training never
    waits for storage. `wait()` blocks until the queue is written. The writer whose
    part completes an attempt commits it and prunes to the newest `keep`."""

    def __init__(self, storage, node: int, layers: int, keep: int = 0):
        self.storage, self.node, self.layers, self.keep = storage, node, layers, keep
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def write(self, attempt: Attempt, blobs: dict[int, bytes], extra: dict | None = None) -> None:
        self.wait()

        def run():
            try:
                write_part(self.storage, attempt, self.node, blobs, extra, self.layers, self.keep)
            except BaseException as e:  # reported by the next wait()
                self.error = e
        self._thread = threading.Thread(target=run, daemon=True, name="checkpoint")
        self._thread.start()

    def wait(self) -> None:
        if self._thread:
            self._thread.join()
            self._thread = None
        if self.error:
            error, self.error = self.error, None
            raise CheckpointError(f"checkpoint write failed: {error}") from error


class Checkpoints:
    """A worker's checkpoint duties: when one is due (every K iterations, or T
    seconds after the last), writing its layers in the background, and loading the
    newest (--resume) or the one the agents chose (a stage lost on every node)."""

    def __init__(self, cfg, node: int, layers: int):
        """`cfg` (JobConfig): where, how often, how many to keep, and the run's name."""
        self.location, self.layers, self.run = cfg.checkpoints.checkpoint, layers, cfg.checkpoints.run
        # in every commit record: what bamboo-export needs, and whose checkpoints these are
        self.record = {"model": asdict(cfg.model), "job": cfg.cluster.job}
        self.every, self.seconds = cfg.checkpoints.checkpoint_every, cfg.checkpoints.checkpoint_seconds
        self.storage = storage_for(cfg.checkpoints.checkpoint) if cfg.checkpoints.checkpoint else None
        self.writer = Writer(self.storage, node, layers, cfg.checkpoints.checkpoint_keep) if self.storage else None
        self.began = time.time()

    def due(self, iteration: int, last: float | None) -> bool:
        """Whether to checkpoint after `iteration`; `last`: when the last was decided."""
        if not self.writer:
            return False
        if self.every and (iteration + 1) % self.every == 0:
            return True
        return bool(self.seconds) and time.time() - (last or self.began) >= self.seconds

    def write(self, iteration: int, epoch: int, blobs: dict[int, bytes], loss_scale=None) -> None:
        """The checkpoint taken before `iteration` by epoch `epoch`'s members (an
        attempt of its own), written in the background; with fp16, the loss scale
        record of the iteration before it (protocol.LossScale). The job's name and
        its config's model section go with it."""
        extra = {**self.record, **({"loss_scale": loss_scale.to_dict()} if loss_scale else {})}
        self.writer.write(Attempt(iteration, f"{self.run}-e{epoch:06d}"), blobs, extra)

    def hashes(self, iteration: int) -> dict[int, str]:
        """layer -> sha256 of the committed checkpoint taken before `iteration` (empty:
        none, or storage unreachable: a rollback from memory must not need it)."""
        try:
            return layer_hashes(self.storage, iteration) if self.storage else {}
        except (OSError, ValueError) as e:  # ValueError: objects.ObjectError
            print(f"bamboo.state.checkpoint: the copies are not checked: {str(e).splitlines()[0][:200]}",
                  file=sys.stderr, flush=True)
            return {}

    def wait(self) -> None:
        if self.writer:
            self.writer.wait()

    def newest(self) -> tuple[int, dict[int, bytes]]:
        found = latest(self.storage, self.layers) if self.storage else None
        if found is None:
            raise CheckpointError(f"--resume: no complete checkpoint in {self.location}")
        return found

    def loss_scale(self, iteration: int) -> dict | None:
        """The loss scale record stored with the checkpoint taken before `iteration`."""
        return stored_extra(self.storage, iteration, "loss_scale")

    def taken_before(self, iteration: int) -> dict[int, bytes]:
        """Every layer of the checkpoint taken before `iteration` (the agents' choice)."""
        found = load(self.storage, iteration, self.layers) if self.storage else None
        if found is None:
            raise CheckpointError("a stage was lost on every node and there is no complete checkpoint")
        return found


def loaded(blob: bytes) -> dict:
    """A layer snapshot ({"params", "optim"}) from storage or a peer: untrusted. Only
    tensors and plain containers load; anything else is refused, unrun, with one
    line (CheckpointError)."""
    try:
        state = torch.load(io.BytesIO(blob), weights_only=True)
    except pickle.UnpicklingError as e:
        said = [line for line in str(e).splitlines() if "GLOBAL" in line or "Unsupported" in line]
        why = said[0].strip()[:200] if said else type(e).__name__
        raise CheckpointError(f"a layer snapshot holds more than tensors and was not loaded ({why})") from None
    except (RuntimeError, EOFError, ValueError) as e:  # not torch.save's format at all
        raise CheckpointError(f"a layer snapshot is not one ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(state, dict) or not isinstance(state.get("params"), dict) \
            or not isinstance(state.get("optim"), dict):
        raise CheckpointError("a layer snapshot is not one (no params and optim tables): not loaded")
    return state


def restore(blob: bytes, layer: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load one layer's parameters and AdamW state from a snapshot (`loaded`)."""
    state = loaded(blob)
    layer.load_state_dict(state["params"])
    for name, p in layer.named_parameters():
        saved = state["optim"].get(name)
        if saved:
            optimizer.state[p] = {k: (v.to(p.device) if torch.is_tensor(v) and v.dim() else v)
                                  for k, v in saved.items()}
