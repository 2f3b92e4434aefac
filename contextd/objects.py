"""The object tier: payloads in an S3-compatible object store (AWS S3, Ceph RGW, MinIO and the like).

When contextd runs with `--object-store s3://BUCKET[/PREFIX]`, the object store is the durable
tier and the local store folder is a cache in front of it: a payload is uploaded before the
manifest row that names it is committed (so a page leaves attention only once the object store
holds it), and a payload missing from the folder is downloaded back on demand, its checksum checked
before anyone reads it. Keys are the payloads' locators under PREFIX/payloads/.

Client: boto3 (botocore underneath). It is the reference S3 client, pure Python, maintained by AWS
and released weekly, and it speaks every S3 dialect we target through one endpoint setting; minio-py
was the alternative (also pure Python, but it pulls compiled dependencies and is MinIO-centric).
Its own retries are off: every call here runs under one deadline with exponential backoff and full
jitter between attempts, so a store that is down or stalls is a clear `TierUnavailable` after
`deadline_s`, never a hang. Checksums are the manifest's xxh3-128, verified on every download;
botocore's own request checksums are asked for only where S3 requires them (Ceph 16's RGW does not
understand the trailing checksums newer botocore sends by default).

Credentials come from the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, or any source
botocore reads), never from the command line.

Dependency rules: boto3 (imported when an object store is configured), xxhash, contextd.errors and
contextd.blobs; the daemon calls this module, never the reverse.
"""

from __future__ import annotations

import functools
import os
import random
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from contextd.blobs import TEMP_PREFIX, fsync_dir
from contextd.clock import Clock, current
from contextd.errors import DataCorrupt, InvalidArgument, TierUnavailable

__all__ = ["ConditionFailed", "ObjectStore", "ObjectStoreConfig"]

T = TypeVar("T")

_URL = re.compile(r"s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(?P<prefix>[A-Za-z0-9._/-]*))?")
# S3's smallest part but the last is 5 MiB; a SmolLM2 page is ~5.9 MB and an 8B model's ~19 MB.
MIN_PART_BYTES = 5 << 20
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ObjectStoreConfig:
    """Where the object tier lives and how long an operation may take.

    `url` is s3://BUCKET[/PREFIX]; `endpoint` the store's address (http://127.0.0.1:7480 for a local
    RGW; empty for AWS itself). Each request of an operation (a payload's upload or download) may
    retry until `deadline_s` after the request's first attempt: attempts that fail with a connection
    error, a timeout or a 5xx are retried after min(cap, base * 2^n) * random() seconds, and one
    attempt lasts at most the connect plus the read timeout. Payloads over `part_bytes` go up in
    parts of that size."""

    url: str
    endpoint: str = ""
    region: str = "us-east-1"
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 20.0
    deadline_s: float = 30.0
    backoff_base_s: float = 0.1
    backoff_cap_s: float = 2.0
    part_bytes: int = 8 << 20

    def __post_init__(self) -> None:
        if _URL.fullmatch(self.url) is None:
            raise InvalidArgument(f"object store {self.url!r} is not s3://BUCKET[/PREFIX] "
                                  "(a lower-case S3 bucket name)")
        if self.endpoint and not re.fullmatch(r"https?://[^\s/]+/?", self.endpoint):
            raise InvalidArgument(f"object store endpoint {self.endpoint!r} is not http(s)://HOST[:PORT]")
        if min(self.connect_timeout_s, self.read_timeout_s, self.deadline_s, self.backoff_base_s,
               self.backoff_cap_s) <= 0:
            raise InvalidArgument("object store timeouts and backoff must be positive")
        if self.part_bytes < MIN_PART_BYTES:
            raise InvalidArgument(f"object store parts must be at least {MIN_PART_BYTES} bytes (S3's minimum)")

    @property
    def bucket(self) -> str:
        match = _URL.fullmatch(self.url)
        assert match is not None
        return match["bucket"]

    @property
    def prefix(self) -> str:
        match = _URL.fullmatch(self.url)
        assert match is not None
        prefix = (match["prefix"] or "").strip("/")
        return f"{prefix}/" if prefix else ""


def _status(exc: Any) -> int:
    """The HTTP status of a botocore ClientError (0 when it carries none)."""
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _retryable(exc: Exception) -> bool:
    """Connection errors, timeouts, throttling and 5xx are worth another attempt; a 4xx is not."""
    from botocore.exceptions import BotoCoreError, ClientError

    if isinstance(exc, ClientError):
        status = _status(exc)
        code = str(exc.response.get("Error", {}).get("Code", ""))
        return status >= 500 or status in (408, 429) or code in ("SlowDown", "RequestTimeout", "Throttling")
    return isinstance(exc, BotoCoreError | OSError)


class ConditionFailed(Exception):
    """A conditional write lost: the object changed since its ETag was read, or it exists where
    it was to be created (S3's 412). Internal to contextd.handover, which re-reads and decides."""


class ObjectStore:
    """Payload objects in one bucket under one prefix, and the sessions' small state objects beside
    them (contextd.handover). Thread-safe (a boto3 client is)."""

    def __init__(self, config: ObjectStoreConfig, clock: Clock | None = None) -> None:
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise InvalidArgument("the object tier needs boto3: pip install 'kv-elision[s3]'") from None
        self.config = config
        self.clock = clock or Clock()
        # S3 compares If-Match with the ETag in quotes, Ceph 16's RGW without: unquoted first,
        # and quoted from the first 412 that a re-read shows was this dialect's (write_object).
        self._quote_etags = False
        self.client: Any = boto3.client(
            "s3", endpoint_url=config.endpoint or None, region_name=config.region,
            config=Config(s3={"addressing_style": "path"}, connect_timeout=config.connect_timeout_s,
                          read_timeout=config.read_timeout_s, retries={"total_max_attempts": 1},
                          request_checksum_calculation="when_required",
                          response_checksum_validation="when_required"))

    # -- one deadline, backoff with full jitter ------------------------------------------------
    def _run(self, what: str, op: Callable[[], T]) -> T:
        """`op`, retried after connection errors, timeouts, throttling and 5xx with exponential
        backoff and full jitter until `deadline_s` has passed, or the deadline of the call it runs
        for when that comes first (contextd.clock): no attempt starts after it."""
        call = current()
        deadline = self.clock.monotonic() + self.config.deadline_s
        whose = f"{self.config.deadline_s:g} s"
        if call is not None and call.at < deadline:
            deadline, whose = call.at, "the caller's deadline"
        attempt = 0
        last = "none"
        while True:
            if self.clock.monotonic() >= deadline:
                break
            try:
                return op()
            except Exception as exc:  # noqa: BLE001 - sorted below: retried, or raised typed
                if not _retryable(exc):
                    raise
                attempt += 1
                last = f"{type(exc).__name__}: {str(exc)[:200]}"
                pause = min(self.config.backoff_cap_s, self.config.backoff_base_s * 2 ** attempt) * random.random()
                if self.clock.monotonic() + pause >= deadline:
                    break
                time.sleep(pause)
        raise TierUnavailable(f"the object store at {self.config.endpoint or 'AWS'} did not {what} within "
                              f"{whose} ({attempt} attempts; last: {last})")

    def key(self, locator: str) -> str:
        return f"{self.config.prefix}payloads/{locator}"

    def session_key(self, session_id: str, name: str) -> str:
        """Where a session's own small objects live (its holder, states and transcript chunks)."""
        return f"{self.config.prefix}sessions/{session_id}/{name}"

    # -- the bucket ----------------------------------------------------------------------------
    def ensure_bucket(self) -> None:
        """Create the bucket unless it is there (a daemon's start; fails typed when the store is down)."""
        from botocore.exceptions import ClientError

        def op() -> None:
            try:
                self.client.head_bucket(Bucket=self.config.bucket)
            except ClientError as exc:
                if _status(exc) != 404:
                    raise
                self.client.create_bucket(Bucket=self.config.bucket)

        self._run("answer for its bucket", op)

    # -- payloads ------------------------------------------------------------------------------
    def upload(self, locator: str, path: Path) -> None:
        """Put the payload file at `path` under `locator`'s key: one PUT, or a multipart upload
        (aborted on failure, so no half object is left to pay for) past `part_bytes`."""
        size = path.stat().st_size
        key = self.key(locator)
        if size <= self.config.part_bytes:
            data = path.read_bytes()
            self._run(f"take {locator}", lambda: self.client.put_object(Bucket=self.config.bucket, Key=key, Body=data))
            return
        upload = self._run(f"start an upload of {locator}", lambda: self.client.create_multipart_upload(
            Bucket=self.config.bucket, Key=key))["UploadId"]
        parts = []
        try:
            with open(path, "rb") as f:
                for number in range(1, -(-size // self.config.part_bytes) + 1):
                    chunk = f.read(self.config.part_bytes)

                    def part(n: int = number, c: bytes = chunk) -> Any:
                        return self.client.upload_part(Bucket=self.config.bucket, Key=key, UploadId=upload,
                                                       PartNumber=n, Body=c)

                    parts.append({"PartNumber": number, "ETag": self._run(f"take part {number} of {locator}",
                                                                          part)["ETag"]})
            self._run(f"complete {locator}", lambda: self.client.complete_multipart_upload(
                Bucket=self.config.bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts}))
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.config.bucket, Key=key, UploadId=upload)
            except Exception:  # noqa: BLE001 - the store may be what failed; the bucket's lifecycle rules clean up
                pass
            raise

    def download(self, locator: str, path: Path, size: int, checksum: str) -> None:
        """Fetch `locator` into `path` (a temporary name, fsynced, renamed: a reader sees the whole
        file or none), after checking its size and checksum; DataCorrupt when they differ or
        the object is gone, TierUnavailable when the store does not answer in time."""
        from botocore.exceptions import ClientError

        folder = path.parent
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        temp = folder / f"{TEMP_PREFIX}{uuid.uuid4().hex}"

        def op() -> str:
            hasher = xxhash.xxh3_128()
            got = 0
            body = self.client.get_object(Bucket=self.config.bucket, Key=self.key(locator))["Body"]
            with open(temp, "wb") as f:
                os.fchmod(f.fileno(), 0o600)
                while chunk := body.read(_CHUNK):
                    hasher.update(chunk)
                    f.write(chunk)
                    got += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            if got != size:
                raise DataCorrupt(f"payload {locator} has {got} bytes in the object store, the manifest says {size}")
            return hasher.hexdigest()

        try:
            try:
                actual = self._run(f"give back {locator}", op)
            except ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code", "")) in ("NoSuchKey", "404"):
                    raise DataCorrupt(f"payload {locator} is missing from the object store") from None
                raise
            if actual != checksum:
                raise DataCorrupt(f"payload {locator} failed its checksum in the object store "
                                  f"({actual} != {checksum})")
            os.replace(temp, path)
            fsync_dir(folder)
        finally:
            temp.unlink(missing_ok=True)

    def copy(self, source: str, target: str) -> None:
        """A server-side copy (a branch's payloads: no byte crosses the network)."""
        self._run(f"copy {source}", lambda: self.client.copy_object(
            Bucket=self.config.bucket, Key=self.key(target),
            CopySource={"Bucket": self.config.bucket, "Key": self.key(source)}))

    def delete(self, locator: str) -> None:
        self.delete_object(self.key(locator))

    # -- small objects: a session's holder, states and transcript chunks (contextd.handover) ---
    def read_object(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and ETag (unquoted), or None when there is none."""
        from botocore.exceptions import ClientError

        def op() -> tuple[bytes, str] | None:
            try:
                got = self.client.get_object(Bucket=self.config.bucket, Key=key)
            except ClientError as exc:
                if _status(exc) == 404:
                    return None
                raise
            return got["Body"].read(), str(got["ETag"]).strip('"')

        return self._run(f"give back {key}", op)

    def write_object(self, key: str, data: bytes, *, match: str = "", absent: bool = False) -> str:
        """Put `data` at `key` and return its ETag (unquoted). With `match`, only while the object's
        ETag is that one; with `absent`, only while there is no object: the store decides
        atomically, and ConditionFailed says the condition did not hold.

        A conditional write is idempotent under retry: an attempt the store applied but whose reply
        was lost (a connection reset, a timeout) is sent again, and that retry's 412 is the write's
        own doing. So a 412 after a retried attempt reads the object back, and an object holding
        exactly `data` is this write's (contextd's conditional writes are holder objects, whose bytes
        carry the writer's node, token and lease end, or the key of a state object made for them)."""
        from botocore.exceptions import ClientError

        quoted = self._quote_etags
        while True:
            condition = {"IfNoneMatch": "*"} if absent else \
                {"IfMatch": f'"{match}"' if quoted else match} if match else {}
            attempts = [0]

            def put(condition: dict[str, str] = condition, attempts: list[int] = attempts) -> Any:
                attempts[0] += 1
                return self.client.put_object(Bucket=self.config.bucket, Key=key, Body=data, **condition)

            try:
                return str(self._run(f"take {key}", put)["ETag"]).strip('"')
            except ClientError as exc:
                if _status(exc) != 412:
                    raise
            now = self.read_object(key)
            if attempts[0] > 1 and now is not None and now[0] == data:
                return now[1]
            if match and not quoted and now is not None and now[1] == match:
                # the ETag was the one asked for: this store compares them quoted
                quoted = self._quote_etags = True
                continue
            raise ConditionFailed(key)

    def list_objects(self, under: str) -> Iterator[tuple[str, int, float]]:
        """(key, size, last-modified unix time) of every object whose key starts with the prefix and `under`."""
        token = ""
        while True:
            ask: dict[str, Any] = {"Bucket": self.config.bucket, "Prefix": self.config.prefix + under}
            if token:
                ask["ContinuationToken"] = token
            page: dict[str, Any] = self._run(f"list {under}", functools.partial(self.client.list_objects_v2, **ask))
            for item in page.get("Contents", ()):
                yield str(item["Key"]), int(item["Size"]), float(item["LastModified"].timestamp())
            if not page.get("IsTruncated"):
                return
            token = str(page["NextContinuationToken"])

    def delete_object(self, key: str) -> None:
        self._run(f"delete {key}", lambda: self.client.delete_object(Bucket=self.config.bucket, Key=key))

    def exists(self, locator: str, size: int) -> bool:
        from botocore.exceptions import ClientError

        def op() -> bool:
            try:
                head = self.client.head_object(Bucket=self.config.bucket, Key=self.key(locator))
            except ClientError as exc:
                if _status(exc) == 404:
                    return False
                raise
            return int(head["ContentLength"]) == size

        return self._run(f"say whether it holds {locator}", op)
