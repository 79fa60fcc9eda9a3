"""Checkpoints as files: their layout, when one is complete, and the storages they
live in (a local directory, `s3://bucket/prefix` through boto3 or `gs://bucket/prefix`
through google-cloud-storage). Bytes only, no torch: the agents read it to find where
a redo can restart, and bamboo/state/checkpoint.py writes and loads through it.

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
import json
import os
import re
import tempfile

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


def stored_extra(storage, iteration: int, name: str):
    """The job state `name` a part of the checkpoint taken before `iteration` holds
    beside its layers (the fp16 loss scale), or None."""
    for key in storage.list():
        if key.startswith(f"ckpt-{iteration:08d}/part-"):
            found = json.loads(storage.get(key)).get(name)
            if found is not None:
                return found
    return None
