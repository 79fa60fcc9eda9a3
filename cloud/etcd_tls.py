"""The certificates of a cloud job's etcd (--etcd auto), and how each machine gets
its own without a secret in its user data or startup script.

At launch this machine makes the job's CA in memory (its key is never written)
and puts, in the job's bucket, one folder per etcd member (the CA, the member's
certificate for the address the cloud gave it, and that address) and one for the
nodes (the CA and the job user's client certificate). An instance reads its
folder with its own cloud identity (the instance profile on EC2, the service
account on GCP), through `python -m cloud.etcd_tls fetch`, which its boot script
runs until the folder is there. Root's certificate is made for no one: once the
first member has turned auth on, nobody can change the members or the roles.
The operator's copy of the client certificate stays beside the launch record,
for bamboo-status. `down` removes the folders."""
from __future__ import annotations

import argparse
import re
import sys

from bamboo.control.credentials import PARTS, Authority, write_files

NODE = "node"
NODE_FILES = PARTS                                         # ca.pem, client.pem, client-key.pem
MEMBER_FILES = ("ca.pem", "server.pem", "server-key.pem", "host")   # host: the address its certificate names
HOST = re.compile(r"[A-Za-z0-9.:-]{1,253}")
MAX_FILE_BYTES = 64 * 1024                                 # a PEM is a few KiB: anything larger is not ours


def member_folder(member: int) -> str:
    return f"etcd-{member}"


class JobCertificates:
    """Signs and ships a launch's certificates: `put(uri, data)` stores an object
    (a shipper's), and `folder(name)` is where an instance fetches its own."""

    def __init__(self, job: str, location: str, put, install, dry_run: bool = False):
        """`location`: s3://BUCKET/KEY or gs://BUCKET/KEY below which the folders go;
        `install` (common.Install): the project, which the etcd instances install
        (without its dependencies) for the fetcher."""
        self.job, self.location, self.put, self.dry_run = job, location.rstrip("/"), put, dry_run
        self.install = install
        self.authority = Authority(job)
        self.shipped: list[str] = []    # every object written, as URIs (down removes them)

    def folder(self, name: str) -> str:
        return f"{self.location}/{name}/"

    def _ship(self, name: str, files: dict[str, bytes]) -> str:
        for part, data in files.items():
            uri = self.folder(name) + part
            self.put(uri, data)
            self.shipped.append(uri)
        return self.folder(name)

    def member(self, member: int, host: str) -> str:
        """Member `member`'s folder, its certificate valid for `host` (the address
        the cloud gave the instance, which peers and nodes dial)."""
        hosts = () if self.dry_run else (host,)
        return self._ship(member_folder(member), {"ca.pem": self.authority.ca_pem, **self.authority.server(hosts),
                                                  "host": host.encode()})

    def nodes(self, local_dir: str | None) -> str:
        """The nodes' folder; the same client certificate written to `local_dir`
        too (the operator's, for bamboo-status through the tunnel)."""
        files = {"ca.pem": self.authority.ca_pem, **self.authority.client()}
        if local_dir and not self.dry_run:
            write_files(local_dir, files)
        return self._ship(NODE, files)


class FetchError(RuntimeError):
    """A folder not there yet, or not readable with this machine's identity."""


def fetch(folder: str, directory: str, names: tuple[str, ...]) -> str:
    """`names` from `folder` (s3://... or gs://..., ending in /) into `directory`,
    owner-only, each whole (the boot script tries again until all are there)."""
    from bamboo.data.objects import ObjectError, bucket_of
    bucket, prefix = bucket_of(folder)
    files = {}
    for name in names:
        try:
            data = bucket.get(prefix + name)
        except KeyError:
            raise FetchError(f"{folder}{name} is not there (yet)") from None
        except ObjectError as e:
            raise FetchError(str(e)) from None
        if name == "host":
            if not HOST.fullmatch(data.decode("ascii", "replace").strip()):
                raise FetchError(f"{folder}{name}: not a host name or address")
        elif len(data) > MAX_FILE_BYTES or b"-----BEGIN " not in data:
            raise FetchError(f"{folder}{name}: not a PEM file of at most {MAX_FILE_BYTES} bytes")
        files[name] = data
    return write_files(directory, files)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cloud.etcd_tls", description="fetch an instance's etcd certificates")
    sub = ap.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch")
    f.add_argument("folder", help="s3://BUCKET/KEY/ or gs://BUCKET/KEY/")
    f.add_argument("directory")
    f.add_argument("--role", choices=("node", "member"), required=True)
    args = ap.parse_args(argv)
    try:
        fetch(args.folder if args.folder.endswith("/") else args.folder + "/", args.directory,
              NODE_FILES if args.role == "node" else MEMBER_FILES)
    except FetchError as e:
        print(f"etcd certificates: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
