"""The launch records of this machine (`--state`, .bamboo-launch.json by default):
one record per job, so a second launch from the same directory adds its own and
`down` of one job leaves the others' (their groups would otherwise be forgotten,
and billed until someone found them). A file written before records were kept per
job (one record at the top) is read as that one job. Writes go to a temp file
renamed into place.
"""
from __future__ import annotations

import json
import os
import tempfile

from cloud.common import BadInput, LaunchError

# what `status`, `scale` and `down` read of a launch record, by provider
RECORD_KEYS = {"ec2": ("region", "job", "etcd", "wheel"), "gcp": ("project", "region", "job", "etcd", "wheel")}


def read_records(path: str) -> dict[str, dict]:
    """job -> its record ({} when there is no file)."""
    try:
        with open(path) as f:
            found = json.load(f)
    except FileNotFoundError:
        return {}
    except (ValueError, OSError) as e:
        raise LaunchError(f"{path} is not a launch record ({type(e).__name__})") from None
    if isinstance(found, dict) and "provider" in found:  # one job's, at the top
        found = {"jobs": {str(found.get("job")): found}}
    jobs = found.get("jobs") if isinstance(found, dict) else None
    if not isinstance(jobs, dict):
        raise LaunchError(f"{path} is not a launch record (no provider ec2 or gcp in it)")
    for record in jobs.values():
        _check(path, record)
    return jobs


def _check(path: str, record) -> None:
    keys = RECORD_KEYS.get(record.get("provider")) if isinstance(record, dict) else None
    if keys is None:
        raise LaunchError(f"{path} is not a launch record (no provider ec2 or gcp in it)")
    if missing := [k for k in keys if k not in record]:
        raise LaunchError(f"{path} is not a complete launch record (no {', '.join(missing)})")


def pick(records: dict[str, dict], job: str | None, path: str) -> dict:
    """The record of `job`, or the only one when no job is named."""
    if not records:
        raise LaunchError(f"no launch recorded in {path} (run bamboo-launch ec2|gcp first, or pass --state)")
    if job is None:
        if len(records) > 1:
            raise LaunchError(f"{path} records jobs {', '.join(sorted(records))}: name one")
        return next(iter(records.values()))
    if job not in records:
        raise LaunchError(f"no job {job!r} recorded in {path} (it records {', '.join(sorted(records))})")
    return records[job]


def check_unrecorded(path: str, job: str) -> None:
    """A launch of a job this file records already would forget the first one's group."""
    if job in read_records(path):
        raise BadInput(f"job {job!r} is recorded in {path} already: bamboo-launch down {job} first, or give "
                          f"another --job")


def write_records(path: str, records: dict[str, dict]) -> None:
    """The records, or no file when none is left."""
    if not records:
        if os.path.exists(path):
            os.unlink(path)
        return
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"jobs": records}, f, indent=1)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
