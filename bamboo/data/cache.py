"""A machine's local copies of `--data` objects (s3://, gs://): each downloaded
once, then mapped from disk by every process like any local file.

The cache lives in BAMBOO_DATA_CACHE (default ~/.cache/bamboo/data). A copy's
path carries the object's version (S3's ETag, GCS's generation), so a changed
object is fetched again and an unchanged one never is: a run asks for the
object's metadata, not its bytes. The download goes to a temp file renamed into
place once whole, under an exclusive lock, so workers starting together on one
machine fetch it once and a crash mid-download leaves nothing a later run takes
for the object (its temp file is removed by the next download).
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import os
import shutil
import tempfile

from bamboo.data.objects import ObjectError, Stat, bucket_of

CACHE_ENV = "BAMBOO_DATA_CACHE"


def cache_dir() -> str:
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "bamboo", "data")


def stat(uri: str, client=None) -> Stat:
    """The object's size and version; one line naming it when it cannot be read."""
    bucket, key = bucket_of(uri, client)
    if not key or key.endswith("/"):
        raise ObjectError(f"{uri!r}: names a bucket or a folder, not an object")
    try:
        return bucket.stat(key)
    except KeyError:
        raise ObjectError(f"{uri}: no such object") from None


def local_copy(uri: str, client=None) -> str:
    """The path of this machine's copy of `uri`, downloaded now if it has none of
    the object's current version."""
    bucket, key = bucket_of(uri, client)
    found = stat(uri, client)
    entry = os.path.join(cache_dir(), _digest(uri))
    path = os.path.join(entry, _digest(found.version), os.path.basename(key))
    if _whole(path, found):
        return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with _locked(os.path.join(entry, ".lock")):
        if not _whole(path, found):  # another process may have fetched it while we waited
            _download(bucket, key, found, path, uri)
            _drop_other_versions(entry, os.path.dirname(path))
    return path


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _whole(path: str, found: Stat) -> bool:
    try:
        return os.path.getsize(path) == found.size
    except OSError:
        return False


@contextlib.contextmanager
def _locked(path: str):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _download(bucket, key: str, found: Stat, path: str, uri: str) -> None:
    """Into a temp file beside `path`, renamed onto it once whole (we hold the lock)."""
    folder = os.path.dirname(path)
    for stale in glob.glob(os.path.join(folder, "*.part")):  # a crashed download's
        os.unlink(stale)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            bucket.download(key, found, out)
            out.flush()
            os.fsync(out.fileno())
        if os.path.getsize(tmp) != found.size:
            raise ObjectError(f"{uri}: downloaded {os.path.getsize(tmp)} bytes of {found.size}")
        os.replace(tmp, path)
    except KeyError:
        raise ObjectError(f"{uri}: no such object (deleted while downloading)") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _drop_other_versions(entry: str, keep: str) -> None:
    """Older versions of the object (processes that map one keep their pages)."""
    for folder in glob.glob(os.path.join(entry, "*")):
        if os.path.isdir(folder) and folder != keep:
            shutil.rmtree(folder, ignore_errors=True)
