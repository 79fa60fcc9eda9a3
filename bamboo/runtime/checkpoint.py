"""Checkpoints: per layer (so a resume may use another depth), atomic, written in
the background, to a local directory or to `s3://bucket/prefix` (boto3) or
`gs://bucket/prefix` (google-cloud-storage).

Layout under the root, for a checkpoint taken before iteration i:

    ckpt-<i>/layer<k>.pt        parameters and AdamW state of layer k
    ckpt-<i>/part-<node>.json   written last by each writer: its layers and their sha256

A checkpoint is complete when its parts name every layer and each file matches
its hash; a write cut short (a SIGKILL) leaves at most files no part names, and
loading falls back to the newest complete checkpoint. Local files are written to
a temp name and renamed; an S3 or GCS PUT is atomic on its own.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import tempfile
import threading
import time

import torch


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that cannot be written."""


class LocalStorage:
    def __init__(self, root: str):
        self.root = root

    def put(self, key: str, data: bytes) -> None:
        path = os.path.join(self.root, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    def get(self, key: str) -> bytes:
        with open(os.path.join(self.root, key), "rb") as f:
            return f.read()

    def list(self) -> list[str]:
        out = []
        for dirpath, _, files in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            out += [os.path.normpath(os.path.join(rel, f)) for f in files if not f.endswith(".tmp")]
        return out


class ObjectStorage:
    """Checkpoints under s3://bucket/prefix or gs://bucket/prefix (bamboo/data/objects.py)."""

    def __init__(self, url: str, client=None):
        from bamboo.data.objects import ObjectError, bucket_of
        try:
            self.bucket, prefix = bucket_of(url, client)
        except ObjectError as e:
            raise CheckpointError(f"checkpoint location {e}") from None
        self.prefix = prefix.strip("/")

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes) -> None:
        self.bucket.put(self._key(key), data)

    def get(self, key: str) -> bytes:
        return self.bucket.get(self._key(key))  # KeyError when missing, as a missing local file is an OSError

    def list(self) -> list[str]:
        start = f"{self.prefix}/" if self.prefix else ""
        return [key[len(start):] for key in self.bucket.list(start)]


S3Storage = GcsStorage = ObjectStorage  # the scheme picks the cloud


def storage_for(location: str, client=None):
    from bamboo.data.objects import is_remote
    return ObjectStorage(location, client) if is_remote(location) else LocalStorage(location)


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
    waits for storage. `wait()` blocks until the queue is written."""

    def __init__(self, storage, node: int):
        self.storage, self.node = storage, node
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def write(self, iteration: int, blobs: dict[int, bytes], extra: dict | None = None) -> None:
        self.wait()

        def run():
            try:
                write_part(self.storage, iteration, self.node, blobs, extra)
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

    def __init__(self, location: str | None, node: int, layers: int, every: int = 0, seconds: float = 0):
        self.location, self.layers, self.every, self.seconds = location, layers, every, seconds
        self.storage = storage_for(location) if location else None
        self.writer = Writer(self.storage, node) if self.storage else None
        self.began = time.time()

    def due(self, iteration: int, last: float | None) -> bool:
        """Whether to checkpoint after `iteration`; `last`: when the last was decided."""
        if not self.writer:
            return False
        if self.every and (iteration + 1) % self.every == 0:
            return True
        return bool(self.seconds) and time.time() - (last or self.began) >= self.seconds

    def write(self, iteration: int, blobs: dict[int, bytes], loss_scale=None) -> None:
        """The checkpoint taken before `iteration`, written in the background; with
        fp16, the loss scale record of the iteration before it (protocol.LossScale)."""
        self.writer.write(iteration, blobs, {"loss_scale": loss_scale.to_dict()} if loss_scale else None)

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
        for key in self.storage.list():
            if key.startswith(f"ckpt-{iteration:08d}/part-"):
                found = json.loads(self.storage.get(key)).get("loss_scale")
                if found is not None:
                    return found
        return None

    def taken_before(self, iteration: int) -> dict[int, bytes]:
        """Every layer of the checkpoint taken before `iteration` (the agents' choice)."""
        found = load(self.storage, iteration, self.layers) if self.storage else None
        if found is None:
            raise CheckpointError("a stage was lost on every node and there is no complete checkpoint")
        return found


def write_part(storage, iteration: int, node: int, blobs: dict[int, bytes], extra: dict | None = None) -> None:
    """A node's layers, then its part file naming them (with their hashes, and any
    `extra` state of the job): a part is only read once its layers are written."""
    hashes = {}
    for index, data in sorted(blobs.items()):
        storage.put(f"ckpt-{iteration:08d}/layer{index}.pt", data)
        hashes[str(index)] = hashlib.sha256(data).hexdigest()
    storage.put(f"ckpt-{iteration:08d}/part-{node}.json", json.dumps({"layers": hashes, **(extra or {})}).encode())


def latest(storage, num_layers: int, at_most: int | None = None,
           above: int | None = None) -> tuple[int, dict[int, bytes]] | None:
    """(iteration, layer index -> bytes) of the newest complete checkpoint (taken
    before iteration `at_most` or earlier, and after `above`, if given), or None.
    Only the checkpoints in that range are read."""
    keys = storage.list()
    iterations = sorted({int(m.group(1)) for k in keys if (m := re.match(r"ckpt-(\d+)/part-", k))},
                        reverse=True)
    iterations = [it for it in iterations if (at_most is None or it <= at_most) and (above is None or it > above)]
    for it in iterations:
        blobs = _complete(storage, keys, it, num_layers)
        if blobs is not None:
            return it, blobs
    return None


def load(storage, iteration: int, num_layers: int) -> dict[int, bytes] | None:
    """The checkpoint taken before `iteration`, if it is complete."""
    return _complete(storage, storage.list(), iteration, num_layers)


def _complete(storage, keys: list[str], it: int, num_layers: int) -> dict[int, bytes] | None:
    """Layer index -> bytes of checkpoint `it` if its parts name every layer and
    every file matches its hash, else None."""
    hashes: dict[int, str] = {}
    for k in keys:
        if k.startswith(f"ckpt-{it:08d}/part-"):
            try:
                hashes.update({int(i): h for i, h in json.loads(storage.get(k))["layers"].items()})
            except (ValueError, KeyError):
                continue
    if sorted(hashes) != list(range(num_layers)):
        return None
    blobs = {}
    for index, h in hashes.items():
        try:
            data = storage.get(f"ckpt-{it:08d}/layer{index}.pt")
        except (OSError, KeyError):  # listed, then gone (deleted, or a write that never finished)
            return None
        if hashlib.sha256(data).hexdigest() != h:
            return None
        blobs[index] = data
    return blobs


def restore(blob: bytes, layer: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load one layer's parameters and AdamW state from a snapshot."""
    state = torch.load(io.BytesIO(blob), weights_only=False)
    layer.load_state_dict(state["params"])
    for name, p in layer.named_parameters():
        saved = state["optim"].get(name)
        if saved:
            optimizer.state[p] = {k: (v.to(p.device) if torch.is_tensor(v) and v.dim() else v)
                                  for k, v in saved.items()}
