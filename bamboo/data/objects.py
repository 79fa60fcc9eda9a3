"""Objects in S3 and Cloud Storage, behind one small interface (stat, get,
get_start, put, delete, list, download) so checkpoints and data need not know which cloud holds them.

Clients come from each cloud's standard credential chain; the endpoints can be
moved (tests, S3-compatible stores) with BAMBOO_S3_ENDPOINT and
BAMBOO_GCS_ENDPOINT. Every failure a user can cause (no such bucket or object,
no permission, no route, no credentials) becomes an ObjectError whose one line
names the object: a ValueError, so bamboo-train reports it as bad input.
"""
from __future__ import annotations

import dataclasses
import os

REMOTE = ("s3://", "gs://")
S3_ENDPOINT, GCS_ENDPOINT = "BAMBOO_S3_ENDPOINT", "BAMBOO_GCS_ENDPOINT"
GCS_RETRY_SECONDS = 20.0  # transient GCS errors are retried this long, not the client's 120 s


class ObjectError(ValueError):
    """An object or bucket that cannot be reached, read or written."""


@dataclasses.dataclass(frozen=True)
class Stat:
    size: int
    version: str  # S3's ETag, GCS's generation: changes whenever the object does


def is_remote(path) -> bool:
    return str(path).startswith(REMOTE)


def split(uri: str) -> tuple[str, str, str]:
    """s3://BUCKET/KEY or gs://BUCKET/KEY -> (scheme, bucket, key)."""
    scheme = next((s for s in REMOTE if uri.startswith(s)), None)
    bucket, _, key = uri[len(scheme or ""):].partition("/")
    if scheme is None or not bucket:
        raise ObjectError(f"{uri!r}: expected s3://BUCKET/KEY or gs://BUCKET/KEY")
    return scheme, bucket, key


def bucket_of(uri: str, client=None):
    """(the bucket's S3Bucket or GcsBucket, the key) of `uri`."""
    scheme, bucket, key = split(uri)
    return (S3Bucket if scheme == "s3://" else GcsBucket)(bucket, client), key


class S3Bucket:
    def __init__(self, bucket: str, client=None):
        import boto3
        self.bucket = bucket
        self.client = client or boto3.client("s3", endpoint_url=os.environ.get(S3_ENDPOINT) or None)

    def _call(self, what: str, key: str, fn):
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            return fn()
        except ClientError as e:
            err = e.response.get("Error", {})
            code = err.get("Code", "?")
            if code in ("NoSuchKey", "404", "NotFound"):
                raise KeyError(key) from None
            raise ObjectError(f"s3://{self.bucket}/{key}: cannot {what} it: {code} {err.get('Message', '')}"
                              .rstrip()) from None
        except BotoCoreError as e:
            raise ObjectError(f"s3://{self.bucket}/{key}: cannot {what} it: {e}") from None

    def stat(self, key: str) -> Stat:
        """Raises KeyError for a missing object (ObjectError for a missing bucket)."""
        try:
            head = self._call("read", key, lambda: self.client.head_object(Bucket=self.bucket, Key=key))
        except KeyError:  # a HEAD's 404 does not say whether the bucket is missing too
            try:
                self._call("read", key, lambda: self.client.head_bucket(Bucket=self.bucket))
            except KeyError:
                raise ObjectError(f"s3://{self.bucket}/{key}: cannot read it: no such bucket") from None
            raise
        return Stat(int(head["ContentLength"]), head["ETag"])

    def get(self, key: str) -> bytes:
        return self._call("read", key, lambda: self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read())

    def get_start(self, key: str, size: int) -> bytes:
        """The object's first `size` bytes (fewer when it is shorter): a ranged GET."""
        return self._call("read", key, lambda: self.client.get_object(
            Bucket=self.bucket, Key=key, Range=f"bytes=0-{size - 1}")["Body"].read())

    def put(self, key: str, data: bytes) -> None:
        self._call("write", key, lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=data))

    def delete(self, key: str) -> None:
        """Remove `key` (S3 answers a missing one as removed)."""
        self._call("delete", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=key))

    def list(self, prefix: str) -> list[str]:
        paginator = self.client.get_paginator("list_objects_v2")
        pages = self._call("list", prefix, lambda: list(paginator.paginate(Bucket=self.bucket, Prefix=prefix)))
        return [obj["Key"] for page in pages for obj in page.get("Contents", [])]

    def download(self, key: str, stat: Stat, out) -> None:
        """The version `stat` saw (IfMatch), streamed into the file object `out`."""
        def fetch():
            body = self.client.get_object(Bucket=self.bucket, Key=key, IfMatch=stat.version)["Body"]
            for chunk in iter(lambda: body.read(1 << 20), b""):
                out.write(chunk)
        self._call("read", key, fetch)


class GcsBucket:
    def __init__(self, bucket: str, client=None):
        self.name = bucket
        self.client = client or _gcs_client(bucket)
        self.bucket = self.client.bucket(bucket)

    def _call(self, what: str, key: str, fn):
        from google.api_core.exceptions import GoogleAPICallError, NotFound, RetryError
        from google.auth.exceptions import GoogleAuthError
        from requests.exceptions import RequestException
        try:
            return fn()
        except NotFound as e:
            if "bucket" in (e.message or "").lower():
                raise ObjectError(f"gs://{self.name}/{key}: cannot {what} it: no such bucket") from None
            raise KeyError(key) from None
        except GoogleAPICallError as e:
            raise ObjectError(f"gs://{self.name}/{key}: cannot {what} it: {e.code} {e.message}") from None
        except (RetryError, GoogleAuthError, RequestException) as e:
            raise ObjectError(f"gs://{self.name}/{key}: cannot {what} it: {str(e).splitlines()[0]}") from None

    def stat(self, key: str) -> Stat:
        blob = self.bucket.blob(key)
        self._call("read", key, lambda: blob.reload(retry=_retry()))  # get_blob() hides a missing bucket
        return Stat(int(blob.size), str(blob.generation))

    def get(self, key: str) -> bytes:
        return self._call("read", key, lambda: self.bucket.blob(key).download_as_bytes(retry=_retry()))

    def get_start(self, key: str, size: int) -> bytes:
        """The object's first `size` bytes (fewer when it is shorter): a ranged download."""
        return self._call("read", key, lambda: self.bucket.blob(key).download_as_bytes(
            start=0, end=size - 1, retry=_retry()))

    def put(self, key: str, data: bytes) -> None:
        self._call("write", key, lambda: self.bucket.blob(key).upload_from_string(data, retry=_retry()))

    def delete(self, key: str) -> None:
        """Remove `key` (gone already: nothing to do)."""
        from google.api_core.exceptions import NotFound

        def remove():
            try:
                self.bucket.blob(key).delete(retry=_retry())
            except NotFound:
                pass
        self._call("delete", key, remove)

    def list(self, prefix: str) -> list[str]:
        return self._call("list", prefix, lambda: [b.name for b in self.client.list_blobs(
            self.name, prefix=prefix, retry=_retry())])

    def download(self, key: str, stat: Stat, out) -> None:
        """The generation `stat` saw, streamed into `out` (its hash checked by the client)."""
        blob = self.bucket.blob(key, generation=int(stat.version))
        self._call("read", key, lambda: blob.download_to_file(out, retry=_retry()))


def _retry():
    from google.cloud.storage.retry import DEFAULT_RETRY
    return DEFAULT_RETRY.with_timeout(GCS_RETRY_SECONDS)


def _gcs_client(bucket: str):
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError
    from google.cloud import storage
    try:
        credentials, project = google.auth.default()
    except DefaultCredentialsError:
        raise ObjectError(f"gs://{bucket}: no Google credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud "
                          f"auth application-default login, or the instance's service account)") from None
    endpoint = os.environ.get(GCS_ENDPOINT)
    return storage.Client(project=project or "-", credentials=credentials,
                          client_options={"api_endpoint": endpoint} if endpoint else None)
