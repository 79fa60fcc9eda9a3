"""Shipping the wheel to the nodes through object storage: an S3 object (EC2),
which nodes with a role (--iam-profile) read with it, else through a presigned
URL; a GCS object (GCP), which nodes read with their service account. A URL lives
at most 7 days (S3's limit for these signatures), less under short-lived
credentials: a node booting later needs a new launch (see docs/cloud.md).

With `dry_run` each request is printed, one JSON line, and none is sent."""
from __future__ import annotations

import json
import os
import re

from cloud.common import BadInput, Install, LaunchError

URL_SECONDS = 7 * 24 * 3600


def split_location(location: str, scheme: str) -> tuple[str, str]:
    """BUCKET[/PREFIX] or scheme://BUCKET[/PREFIX] -> (bucket, prefix)."""
    rest = location[len(scheme):] if location.startswith(scheme) else location
    bucket, _, prefix = rest.partition("/")
    if not bucket or "://" in rest:
        raise BadInput(f"--bucket {location!r}: expected BUCKET[/PREFIX] or {scheme}BUCKET[/PREFIX]")
    return bucket, prefix.strip("/")


def default_bucket(job: str, region: str) -> str:
    """The bucket an EC2 launch without --bucket or --package makes for its wheel
    (and removes at down): named after the job and region."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", f"bamboo-{job}-{region}".lower())).strip("-")[:63]


def object_key(prefix: str, job: str, wheel: str) -> str:
    return "/".join(p for p in (prefix, "bamboo-launch", job, os.path.basename(wheel)) if p)


def certificates_location(shipper, job: str) -> str:
    """Where a launch puts its etcd certificates (cloud/etcd_tls.py): beside its wheel."""
    return f"{shipper.scheme}{shipper.bucket}/{object_key(shipper.prefix, job, 'etcd-tls')}"


class S3Shipper:
    scheme = "s3://"

    def __init__(self, location: str, region: str, endpoint_url: str | None, dry_run: bool, log=print,
                 create: bool = False, by_role: bool = False):
        self.bucket, self.prefix = split_location(location, self.scheme)
        self.region, self.dry_run, self.log = region, dry_run, log
        self.endpoint_url = endpoint_url
        self.by_role = by_role  # the nodes read the wheel with their role (--iam-profile): no expiring URL
        self.create = create    # the bucket is the launch's own (default_bucket): made if absent
        self.created = False    # this launch made it: down removes it
        if not dry_run:
            import boto3
            self.s3 = boto3.session.Session(region_name=region).client("s3", endpoint_url=endpoint_url)

    def _call(self, operation: str, **params):
        if self.dry_run:
            shown = {k: (f"<{os.path.basename(v.name)}, {os.fstat(v.fileno()).st_size} bytes>"
                         if hasattr(v, "read") else f"<{len(v)} bytes>" if isinstance(v, bytes) else v)
                     for k, v in params.items()}
            self.log(json.dumps({"service": "s3", "operation": operation, "params": shown}))
            return f"https://{self.bucket}.s3.amazonaws.com/<presigned>" if operation == "generate_presigned_url" \
                else {}
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            if operation == "generate_presigned_url":
                return self.s3.generate_presigned_url(**params)
            return getattr(self.s3, operation)(**params)
        except ClientError as e:
            err = e.response.get("Error", {})
            raise LaunchError(f"S3 refused {operation} on s3://{self.bucket}: {err.get('Code', '?')}: "
                              f"{err.get('Message', '')}") from None
        except BotoCoreError as e:
            raise LaunchError(f"S3 {operation} failed: {e}") from None

    def ship(self, wheel: str, job: str) -> tuple[Install, str]:
        """Upload `wheel`; what nodes install, and the object's URI (for down)."""
        key = object_key(self.prefix, job, wheel)
        if self.create:
            self.ensure_bucket()
        with open(wheel, "rb") as body:
            self._call("put_object", Bucket=self.bucket, Key=key, Body=body)
        name, uri = os.path.basename(wheel), f"s3://{self.bucket}/{key}"
        if self.by_role:
            return Install(name, wheel=name, s3=uri, region=self.region, endpoint_url=self.endpoint_url), uri
        url = self._call("generate_presigned_url", ClientMethod="get_object",
                         Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=URL_SECONDS)
        return Install(name, url, name), uri

    def ensure_bucket(self) -> None:
        if not self.dry_run:
            from botocore.exceptions import ClientError
            try:
                self.s3.head_bucket(Bucket=self.bucket)
                return
            except ClientError:
                pass  # absent (or not ours: create_bucket then says which, in one line)
        where = {} if self.region == "us-east-1" else {
            "CreateBucketConfiguration": {"LocationConstraint": self.region}}
        self._call("create_bucket", Bucket=self.bucket, **where)
        self.created = True

    def put(self, uri: str, data: bytes) -> None:
        """A private object (the job's etcd certificates): readable with the bucket's permissions only."""
        bucket, _, key = uri[len(self.scheme):].partition("/")
        self._call("put_object", Bucket=bucket, Key=key, Body=data)

    def delete(self, uri: str) -> None:
        bucket, _, key = uri[len(self.scheme):].partition("/")
        self._call("delete_object", Bucket=bucket, Key=key)

    def delete_bucket(self) -> None:
        self._call("delete_bucket", Bucket=self.bucket)


class GcsShipper:
    scheme = "gs://"

    def __init__(self, location: str, project: str, endpoint_url: str | None, dry_run: bool, log=print):
        self.bucket, self.prefix = split_location(location, self.scheme)
        self.endpoint_url, self.dry_run, self.log = endpoint_url, dry_run, log
        if dry_run:
            return
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError
        from google.cloud import storage
        try:
            credentials, _ = google.auth.default()
        except DefaultCredentialsError:
            raise LaunchError("no Google credentials (the default chain: GOOGLE_APPLICATION_CREDENTIALS, "
                              "gcloud, the metadata server)") from None
        options = {"api_endpoint": endpoint_url} if endpoint_url else None
        self.client = storage.Client(project=project, credentials=credentials, client_options=options)

    def _call(self, operation: str, key: str, fn):
        if self.dry_run:
            self.log(json.dumps({"service": "storage", "operation": operation, "bucket": self.bucket, "object": key}))
            return None
        from google.api_core.exceptions import GoogleAPICallError
        from google.auth.exceptions import GoogleAuthError
        try:
            return fn(self.client.bucket(self.bucket).blob(key))
        except GoogleAPICallError as e:
            raise LaunchError(f"GCS refused {operation} on gs://{self.bucket}/{key}: {e.message or e}") from None
        except GoogleAuthError as e:
            raise LaunchError(f"GCS {operation} on gs://{self.bucket}/{key}: {e}") from None

    def ship(self, wheel: str, job: str) -> tuple[Install, str]:
        """Upload `wheel`; the nodes read it with their service account (no URL to expire)."""
        key = object_key(self.prefix, job, wheel)
        self._call("upload", key, lambda blob: blob.upload_from_filename(wheel))
        name, uri = os.path.basename(wheel), f"gs://{self.bucket}/{key}"
        return Install(name, wheel=name, gs=uri, endpoint_url=self.endpoint_url), uri

    def put(self, uri: str, data: bytes) -> None:
        key = uri[len(self.scheme):].partition("/")[2]
        self._call("upload", key, lambda blob: blob.upload_from_string(data))

    def delete(self, uri: str) -> None:
        """Remove the object (gone already, as after an interrupted down: nothing to do)."""
        from google.api_core.exceptions import NotFound
        key = uri[len(self.scheme):].partition("/")[2]

        def remove(blob):
            try:
                blob.delete()
            except NotFound:
                pass
        self._call("delete", key, remove)
