"""A job's own certificate authority for its etcd: one CA made at launch, a
server certificate for the members, a client certificate whose common name is
the job's etcd user, and one for etcd's root user (only the launcher, which
sets up the job's role, holds it). A process finds its client credentials in
the directory that BAMBOO_ETCD_TLS names, so workers and agents started by a
launcher inherit them without a flag on every command line."""
from __future__ import annotations

import datetime
import ipaddress
import os
import tempfile
from dataclasses import dataclass

ENV = "BAMBOO_ETCD_TLS"
ROOT_USER = "root"
VALID_DAYS = 30          # a job longer than this relaunches (a new CA) from its checkpoint
PARTS = ("ca.pem", "client.pem", "client-key.pem")


def job_user(job: str) -> str:
    """The etcd user (and certificate common name) of job `job`."""
    return f"bamboo-{job}"


class CredentialError(ValueError):
    """A credentials directory that lacks a file, or files that are no PEM."""


@dataclass(frozen=True)
class ClientFiles:
    """What a client presents: the CA that signed the server, its certificate and key."""
    ca: str
    cert: str
    key: str

    @classmethod
    def in_dir(cls, directory: str, name: str = "client") -> "ClientFiles":
        files = cls(*(os.path.join(directory, p) for p in ("ca.pem", f"{name}.pem", f"{name}-key.pem")))
        missing = [f for f in (files.ca, files.cert, files.key) if not os.path.isfile(f)]
        if missing:
            raise CredentialError(f"etcd credentials in {directory!r}: {os.path.basename(missing[0])} is missing "
                                  f"(a directory needs {', '.join(PARTS)})")
        return files

    def grpc_credentials(self):
        import grpc
        with open(self.ca, "rb") as ca, open(self.key, "rb") as key, open(self.cert, "rb") as cert:
            return grpc.ssl_channel_credentials(ca.read(), key.read(), cert.read())


def from_env() -> ClientFiles | None:
    """This process's client credentials (BAMBOO_ETCD_TLS), or None: a plain etcd."""
    directory = os.environ.get(ENV)
    return ClientFiles.in_dir(directory) if directory else None


def _write(path: str, data: bytes) -> None:
    """Owner-only, whole or not at all (temp file, then rename)."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _name(common: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _certificate(subject: str, key, issuer: str, issuer_key, ca: bool = False, hosts: tuple[str, ...] = ()):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if hosts else [])
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    if hosts:
        builder = builder.add_extension(x509.SubjectAlternativeName([_alt_name(h) for h in hosts]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _alt_name(host: str):
    from cryptography import x509
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


class Authority:
    """A job's CA, held in this process only: what it signs is written or shipped,
    its key never is (once the process ends, no one can sign for this etcd)."""

    def __init__(self, job: str):
        from cryptography.hazmat.primitives import serialization
        self.job, self.name = job, f"bamboo-ca-{job}"
        self._key = _key()
        cert = _certificate(self.name, self._key, self.name, self._key, ca=True)
        self.ca_pem = cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, name: str, common: str, hosts: tuple[str, ...] = ()) -> dict[str, bytes]:
        """NAME.pem and NAME-key.pem for `common` (with `hosts`: a server's too)."""
        from cryptography.hazmat.primitives import serialization
        key = _key()
        cert = _certificate(common, key, self.name, self._key, hosts=hosts)
        return {f"{name}.pem": cert.public_bytes(serialization.Encoding.PEM), f"{name}-key.pem": _pem_key(key)}

    def server(self, hosts: tuple[str, ...]) -> dict[str, bytes]:
        """An etcd member's certificate (also its peer one) for `hosts`, loopback added."""
        return self.issue("server", f"bamboo-etcd-{self.job}", tuple(dict.fromkeys((*hosts, "127.0.0.1", "localhost"))))

    def client(self, job: str | None = None, name: str = "client") -> dict[str, bytes]:
        """The client certificate of job `job`'s etcd user (default: this job's)."""
        return self.issue(name, job_user(job or self.job))

    def root(self) -> dict[str, bytes]:
        return self.issue("root", ROOT_USER)


def write_files(directory: str, files: dict[str, bytes]) -> str:
    """`files` in `directory` (made owner-only), each whole or not at all."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    for name, data in files.items():
        _write(os.path.join(directory, name), data)
    return directory


def make_job_credentials(directory: str, job: str, hosts: tuple[str, ...] = ("127.0.0.1",),
                         also: tuple[str, ...] = ()) -> str:
    """A fresh CA in `directory` (made owner-only) and, signed by it: server.pem
    for etcd members at `hosts` (also their peer certificate), client.pem for the
    job's user, root.pem for etcd's root and client-JOB.pem for each job of `also`
    (other jobs that share this etcd). The CA's key is never written: no one can
    sign another certificate for this etcd. Returns `directory`."""
    ca = Authority(job)
    files = {"ca.pem": ca.ca_pem, **ca.server(hosts), **ca.client(), **ca.root()}
    for other in also:
        files.update(ca.client(other, f"client-{other}"))
    return write_files(directory, files)
