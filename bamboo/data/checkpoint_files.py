"""Checkpoints as files: their layout, when one is complete, and the storages they
live in (a local directory, `s3://bucket/prefix` through boto3 or `gs://bucket/prefix`
through google-cloud-storage). Bytes only, no torch: the agents read it to find where
a redo can restart, and bamboo/state/checkpoint.py writes and loads through it.

Each attempt at the checkpoint taken before iteration i has a folder of its own,
named after the run and the epoch that wrote it (two runs, or a redo that takes the
same checkpoint again, never write into one folder):

    ckpt-<i>-<attempt>/layer<k>.pt        parameters and AdamW state of layer k
    ckpt-<i>-<attempt>/part-<node>.json   written by each writer after its layers: their sha256
    ckpt-<i>-<attempt>/commit.json        written once the parts name every layer: all hashes

Only a committed attempt whose files match the commit's hashes is read; a write
cut short (a SIGKILL) leaves an attempt without a commit, and loading falls back
to the newest committed one. The writer whose part completes an attempt commits
it (two that finish together write the same record) and, with `keep`, removes
its run's committed checkpoints but the newest `keep` iterations (the one just
committed always among them) and the run's uncommitted attempts older than the
oldest kept; a removal that fails is a note, not a failed checkpoint. Local files are written to a temp name and
renamed; an S3 or GCS PUT is atomic on its own.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass

COMMIT = "commit.json"
_KEY = re.compile(r"ckpt-(\d{8,})-([a-z0-9][a-z0-9-]{0,63})/(.+)")
ATTEMPT_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")


@dataclass(frozen=True)
class Attempt:
    """One attempt at the checkpoint taken before `iteration`: `name` is the run's
    and the epoch's (bamboo/state/checkpoint.py)."""
    iteration: int
    name: str

    def __post_init__(self):
        if not ATTEMPT_NAME.fullmatch(self.name):
            raise ValueError(f"checkpoint attempt name {self.name!r}: expected [a-z0-9][a-z0-9-]{{0,63}}")

    @property
    def folder(self) -> str:
        return f"ckpt-{self.iteration:08d}-{self.name}"


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

    def delete(self, key: str) -> None:
        """Remove `key` (gone already: nothing to do) and its folder once empty."""
        path = os.path.join(self.root, key)
        try:
            os.remove(path)
            os.rmdir(os.path.dirname(path))
        except OSError:
            pass  # missing, or the folder still holds files

    def list(self, under: str = "") -> list[str]:
        """Every key (below the folder `under`, ending in "/", if given)."""
        out = []
        for dirpath, _, files in os.walk(os.path.join(self.root, under)):
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

    def delete(self, key: str) -> None:
        self.bucket.delete(self._key(key))

    def list(self, under: str = "") -> list[str]:
        start = f"{self.prefix}/" if self.prefix else ""
        return [key[len(start):] for key in self.bucket.list(start + under)]


S3Storage = GcsStorage = ObjectStorage  # the scheme picks the cloud


def storage_for(location: str, client=None):
    from bamboo.data.objects import is_remote
    return ObjectStorage(location, client) if is_remote(location) else LocalStorage(location)


def write_part(storage, attempt: Attempt, node: int, blobs: dict[int, bytes], extra: dict | None = None,
               layers: int | None = None, keep: int = 0) -> bool:
    """A node's layers, then its part file naming them (with their hashes, and any
    `extra` state of the job): a part is only read once its layers are written.
    With `layers` (the model's count), commit the attempt if the parts now name
    every layer, then keep the newest `keep` checkpoints (0: all). Whether it committed."""
    hashes = {}
    for index, data in sorted(blobs.items()):
        storage.put(f"{attempt.folder}/layer{index}.pt", data)
        hashes[str(index)] = hashlib.sha256(data).hexdigest()
    storage.put(f"{attempt.folder}/part-{node}.json", json.dumps({"layers": hashes, **(extra or {})}).encode())
    if layers is None or not _commit(storage, attempt, layers):
        return False
    if keep:
        try:
            prune(storage, attempt, keep)
        except (OSError, ValueError, KeyError) as e:  # ValueError: objects.ObjectError; the commit stands
            print(f"bamboo.data.checkpoint_files: older checkpoints not removed: {str(e).splitlines()[0][:200]}",
                  file=sys.stderr, flush=True)
    return True


def _commit(storage, attempt: Attempt, layers: int) -> bool:
    """Write the attempt's commit record if its parts name every layer."""
    hashes, extra = {}, {}
    for key in storage.list(attempt.folder + "/"):
        if _KEY.fullmatch(key) and key.startswith(attempt.folder + "/part-"):
            part = _json(storage, key)
            if part is None:
                return False
            hashes.update(part.pop("layers", {}))
            extra.update(part)
    if sorted(int(i) for i in hashes) != list(range(layers)):
        return False
    storage.put(f"{attempt.folder}/{COMMIT}", json.dumps({"layers": hashes, **extra}, sort_keys=True).encode())
    return True


def _json(storage, key: str) -> dict | None:
    try:
        found = json.loads(storage.get(key))
    except (OSError, KeyError, ValueError):
        return None
    return found if isinstance(found, dict) and isinstance(found.get("layers", {}), dict) else None


def _attempts(keys: list[str]) -> tuple[list[Attempt], list[Attempt]]:
    """(committed, every) attempt found in `keys`, newest iteration first."""
    committed, every = set(), set()
    for key in keys:
        m = _KEY.fullmatch(key)
        if m:
            attempt = Attempt(int(m.group(1)), m.group(2))
            every.add(attempt)
            if m.group(3) == COMMIT:
                committed.add(attempt)
    order = (lambda a: (a.iteration, a.name))
    return sorted(committed, key=order, reverse=True), sorted(every, key=order, reverse=True)


def committed(storage) -> list[Attempt]:
    """The committed attempts, newest iteration first."""
    return _attempts(storage.list())[0]


def newest_listed(storage, num_layers: int) -> int | None:
    """The iteration of the newest committed attempt whose commit names every layer
    and whose layer files are all there, found from one listing and the commit
    records: nothing else is read. (Loading it checks each file's hash too.)"""
    keys = set(storage.list())
    for attempt in _attempts(keys)[0]:
        hashes = commit_hashes(_json(storage, f"{attempt.folder}/{COMMIT}") or {})
        if _every_layer(hashes, num_layers) and all(f"{attempt.folder}/layer{i}.pt" in keys for i in hashes):
            return attempt.iteration
    return None


def commit_record(storage, attempt: Attempt) -> dict | None:
    """An attempt's commit record as stored (untrusted: its fields are checked by
    whoever reads them), or None when it is unreadable or no JSON object."""
    return _json(storage, f"{attempt.folder}/{COMMIT}")


def read_layer(storage, attempt: Attempt, index: int, digest: str) -> bytes:
    """One layer file of `attempt`, checked against the hash its commit names
    (CheckpointError when it differs: a file changed or cut short)."""
    data = storage.get(f"{attempt.folder}/layer{index}.pt")
    if hashlib.sha256(data).hexdigest() != digest:
        raise CheckpointError(f"{attempt.folder}/layer{index}.pt does not match its commit's hash")
    return data


def run_of(attempt: Attempt) -> str:
    return attempt.name.rsplit("-e", 1)[0]


def prune(storage, newest: Attempt, keep: int) -> list[Attempt]:
    """After `newest` committed: keep it and its run's checkpoints of the `keep - 1`
    newest other iterations; remove the run's other committed attempts, and its
    uncommitted ones older than the oldest kept. Another run's files are never
    touched (a resumed run leaves the one it resumed from as it was). What was removed."""
    keys = storage.list()
    committed, every = _attempts(keys)
    mine = [a for a in committed if run_of(a) == run_of(newest)]
    others = sorted({a.iteration for a in mine} - {newest.iteration}, reverse=True)
    kept = {newest.iteration, *others[:keep - 1]}
    gone = [a for a in every if run_of(a) == run_of(newest) and a.iteration not in kept
            and (a in mine or a.iteration < min(kept))]
    folders = {a.folder for a in gone}
    for key in sorted(keys, key=lambda k: k.endswith(COMMIT), reverse=True):  # the commit first: never half-read
        if key.split("/", 1)[0] in folders:
            storage.delete(key)
    return gone


class _Gone(Exception):
    """A listed file that is not there any more (pruned meanwhile)."""


def latest(storage, num_layers: int, at_most: int | None = None,
           above: int | None = None) -> tuple[int, dict[int, bytes]] | None:
    """(iteration, layer index -> bytes) of the newest complete checkpoint (taken
    before iteration `at_most` or earlier, and after `above`, if given), or None.
    Only the checkpoints in that range are read; one removed while it was read (a
    newer commit pruned it) sends the search round again."""
    for _ in range(3):
        gone = False
        committed, _ = _attempts(storage.list())
        for attempt in committed:
            if (at_most is None or attempt.iteration <= at_most) and (above is None or attempt.iteration > above):
                try:
                    blobs = _complete(storage, attempt, num_layers)
                except _Gone:
                    gone = True
                    continue
                if blobs is not None:
                    return attempt.iteration, blobs
        if not gone:
            return None
    return None


def load(storage, iteration: int, num_layers: int) -> dict[int, bytes] | None:
    """The checkpoint taken before `iteration`, if an attempt at it is complete."""
    found = latest(storage, num_layers, at_most=iteration, above=iteration - 1)
    return found[1] if found else None


def _complete(storage, attempt: Attempt, num_layers: int) -> dict[int, bytes] | None:
    """Layer index -> bytes of `attempt` if its commit names every layer and every
    file matches its hash, else None; _Gone if a file went meanwhile."""
    try:
        hashes = commit_hashes(json.loads(storage.get(f"{attempt.folder}/{COMMIT}")))
    except (OSError, KeyError):
        raise _Gone() from None
    except ValueError:
        return None
    if not _every_layer(hashes, num_layers):
        return None
    blobs = {}
    for index, h in hashes.items():
        try:
            data = storage.get(f"{attempt.folder}/layer{index}.pt")
        except (OSError, KeyError):
            raise _Gone() from None
        if hashlib.sha256(data).hexdigest() != h:
            return None
        blobs[index] = data
    return blobs


def _every_layer(hashes: dict[int, str] | None, num_layers: int) -> bool:
    """Whether a commit's hashes name each of the model's layers, and no other."""
    return hashes is not None and sorted(hashes) == list(range(num_layers))


def commit_hashes(commit) -> dict[int, str] | None:
    """layer -> sha256 of a commit record, None if it is not one."""
    try:
        return {int(i): str(h) for i, h in commit.get("layers", {}).items()}
    except (AttributeError, ValueError):
        return None


def _commits_at(storage, iteration: int):
    """The commit records of the checkpoint taken before `iteration`, newest attempt first."""
    committed, _ = _attempts(storage.list())
    for attempt in committed:
        if attempt.iteration == iteration:
            yield _json(storage, f"{attempt.folder}/{COMMIT}") or {}


def layer_hashes(storage, iteration: int) -> dict[int, str]:
    """layer -> sha256 in the newest commit of the checkpoint taken before
    `iteration` (empty: none committed): what copies from peers must match."""
    return next((commit_hashes(commit) or {} for commit in _commits_at(storage, iteration)), {})


def stored_extra(storage, iteration: int, name: str):
    """The job state `name` the newest commit of the checkpoint taken before
    `iteration` holds beside its layers (the fp16 loss scale), or None."""
    return next((commit[name] for commit in _commits_at(storage, iteration) if commit.get(name) is not None), None)
