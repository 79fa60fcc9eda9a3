"""etcd's own access control for a job: a role that may read and write only the
job's key prefixes (its protocol keys and its agents' rendezvous), a user of the
job's name holding it, and auth turned on. With client certificates required,
etcd takes the user from the certificate's common name, so the users' passwords
are random and thrown away."""
from __future__ import annotations

import secrets

from bamboo.control.credentials import ROOT_USER, job_user
from bamboo.control.protocol import job_root, rendezvous_prefix

READWRITE = 2  # authpb.Permission.READWRITE


def job_role(job: str) -> str:
    return f"bamboo-job-{job}"


def job_prefixes(job: str) -> tuple[str, ...]:
    """Every key a job's processes read or write lies below one of these."""
    return job_root(job), rendezvous_prefix(job)


def _range_end(prefix: str) -> bytes:
    from pyetcd.utils import prefix_range_end
    return prefix_range_end(prefix.encode())


def _user_add(stub, name: str, timeout: float) -> None:
    from pyetcd.etcdrpc import rpc_pb2
    stub.UserAdd(rpc_pb2.AuthUserAddRequest(name=name, password=secrets.token_urlsafe(24)), timeout)


def grant_job(client, job: str, timeout: float = 5.0) -> None:
    """Add job `job`'s role and user through `client` (root's, or any client while
    auth is still off)."""
    from pyetcd.etcdrpc import auth_pb2, rpc_pb2
    stub, role = client.authstub, job_role(job)
    stub.RoleAdd(rpc_pb2.AuthRoleAddRequest(name=role), timeout)
    for prefix in job_prefixes(job):
        permission = auth_pb2.Permission(permType=READWRITE, key=prefix.encode(), range_end=_range_end(prefix))
        stub.RoleGrantPermission(rpc_pb2.AuthRoleGrantPermissionRequest(name=role, perm=permission), timeout)
    _user_add(stub, job_user(job), timeout)
    stub.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user=job_user(job), role=role), timeout)


def enable_auth(client, job: str, timeout: float = 5.0) -> None:
    """Root (required by etcd before auth goes on), the job's role and user, then
    auth on: from here a client is who its certificate says, and may touch only
    what its role grants."""
    from pyetcd.etcdrpc import rpc_pb2
    stub = client.authstub
    _user_add(stub, ROOT_USER, timeout)
    stub.UserGrantRole(rpc_pb2.AuthUserGrantRoleRequest(user=ROOT_USER, role="root"), timeout)
    grant_job(client, job, timeout)
    stub.AuthEnable(rpc_pb2.AuthEnableRequest(), timeout)
