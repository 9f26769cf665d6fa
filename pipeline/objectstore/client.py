"""The object-store client: a storage worker's contract on an S3 bucket.

``put`` a shard (its SHA-256 sent as ``x-amz-checksum-sha256``: the store refuses bytes that do
not match; multipart and resumable above the target's threshold, pipeline/objectstore/upload.py),
``confirm`` it by the checksum the store keeps, ``get`` it back into a file with parallel ranged
GETs and its SHA-256 verified, ``read_back`` all or a sample of it at a bounded rate (scrub: the
store's checksum is no proof that the bytes are still readable), ``inventory`` by paged listing,
``delete``. Keys are content addressed (pipeline/objectstore/keys.py). Every failure is one of
the errors of pipeline/objectstore/faults.py.

Credentials are boto3's own chain (environment, the target's profile, an instance or container
role); this module never reads, stores nor logs them, and names only where they came from.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pipeline.errors import ObjectMismatch, StoreCredentials
from pipeline.objectstore import faults, keys
from pipeline.objectstore.config import Target

if TYPE_CHECKING:  # boto3 is the optional s3 extra: imported when a store is used, not before
    from botocore import exceptions as bx

if TYPE_CHECKING:
    from pipeline.objectstore import download

T = TypeVar("T")

#: Where botocore says credentials came from (``Credentials.method``), in words.
SOURCES = {"env": "the environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN)",
           "shared-credentials-file": "~/.aws/credentials", "config-file": "~/.aws/config",
           "iam-role": "the instance role (EC2 metadata)", "container-role": "the container role (ECS/EKS)",
           "assume-role": "an assumed role", "sso": "AWS SSO", "custom-process": "a credential_process",
           "assume-role-with-web-identity": "a web identity token"}


@dataclass(frozen=True)
class Stored:
    """An object as the store describes it: its key, size and ``ChecksumSHA256`` (the object's
    SHA-256 in base64 for a single PUT; ``<base64>-<parts>`` for a multipart upload)."""

    key: str
    size: int
    checksum: str


@dataclass(frozen=True)
class Listed:
    """One object of an inventory: the shard it holds, its size, and when the store says it was
    last written (``LastModified``; for a multipart upload, when the upload began)."""

    sha256: str
    size: int
    last_modified: datetime | None = None


class ObjectStore:
    """A connection to one target. Thread-safe; one per process and target is enough."""

    def __init__(self, target: Target, *, client: Any = None) -> None:
        import boto3
        from botocore import exceptions as bx

        self.target = target
        self._profile_error: bx.ProfileNotFound | None = None
        try:
            self._session = boto3.session.Session(profile_name=target.profile or None,
                                                  region_name=target.region or None)
        except bx.ProfileNotFound as exc:
            self._profile_error = exc
            self._session = boto3.session.Session(region_name=target.region or None)
        self._client = client
        self._given = client is not None  # a client passed in (tests) is kept
        self._lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def s3(self) -> Any:
        """The botocore S3 client (built on first use: building one reads the credential chain)."""
        if self._profile_error is not None:
            raise StoreCredentials(self.target.name, f"{self._profile_error}; {self.credentials_hint()}")
        with self._lock:
            if self._client is None:
                from botocore.config import Config

                t = self.target
                config = Config(
                    signature_version="s3v4",  # presigned PUTs too sign their checksum header
                    retries={"mode": "standard", "total_max_attempts": t.max_attempts},
                    connect_timeout=t.connect_timeout, read_timeout=t.read_timeout,
                    max_pool_connections=max(10, 2 * t.concurrency),
                    s3={"addressing_style": t.addressing_style,
                        # The signed x-amz-checksum-sha256 header already binds the body; hashing
                        # it once more for the signature (what plain http would do) costs a pass.
                        "payload_signing_enabled": False},
                    # Only the checksums sent on purpose (a CRC32 of every request is a pass
                    # more); answers are verified here, by SHA-256.
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required")
                self._client = self._session.client("s3", endpoint_url=t.endpoint or None, config=config)
            return self._client

    def credentials_source(self) -> str:
        """Where the credentials come from, in words ("" when none are found); never them."""
        from botocore import exceptions as bx

        if self._profile_error is not None:
            return ""
        try:
            creds = self._session.get_credentials()
        except bx.BotoCoreError:
            return ""
        method = str(getattr(creds, "method", "")) if creds else ""
        return SOURCES.get(method, method)

    def credentials_hint(self) -> str:
        """Where the credentials came from and what to do, never the credentials themselves."""
        p = self.target.profile
        if self._profile_error is not None:
            return (f"profile {p!r} is in neither ~/.aws/credentials nor ~/.aws/config (AWS_SHARED_CREDENTIALS_FILE, "
                    f"AWS_CONFIG_FILE): add it (`aws configure --profile {p}`) or fix the target's profile")
        where = self.credentials_source()
        if not where:
            return ("no credentials were found in the environment, a profile or an instance role: export "
                    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or set the target's profile")
        whose = f" for profile {p!r}" if p else ""
        return (f"the credentials came from {where}{whose}: check or renew them there (expired session tokens: "
                "log in again); jobs wait meanwhile and nothing is marked lost")

    def _bucket_exists(self) -> bool | None:
        from botocore import exceptions as bx

        try:
            self.s3.head_bucket(Bucket=self.target.bucket)
            return True
        except bx.ClientError as exc:
            return False if faults.code_of(exc)[1] == 404 else None
        except bx.BotoCoreError:
            return None

    def call(self, what: str, fn: Callable[..., T], **kwargs: Any) -> T:
        """``fn(**kwargs)`` (a botocore operation), its failure translated (faults.translate)."""
        from botocore import exceptions as bx

        try:
            return fn(**kwargs)
        except (bx.BotoCoreError, bx.ClientError) as exc:
            err = faults.translate(exc, self.target.name, credentials=self.credentials_hint(), what=what,
                                   bucket_exists=self._bucket_exists)
            if err is None:
                raise
            if isinstance(err, StoreCredentials):
                self._renew()
            raise err from exc

    def _renew(self) -> None:
        """Forget the client and its credentials: the next call reads the chain again (keys renewed
        where the error said, in the profile or the role, are used without a restart)."""
        import boto3

        if self._given:
            return
        with self._lock:
            if self._profile_error is None:
                self._session = boto3.session.Session(profile_name=self.target.profile or None,
                                                      region_name=self.target.region or None)
            self._client = None

    def key(self, sha256: str) -> str:
        return keys.key_for(self.target.prefix, sha256)

    def sse_args(self) -> dict[str, str]:
        """The server-side encryption arguments of a PUT or a multipart upload's creation."""
        t = self.target
        if not t.sse:
            return {}
        args = {"ServerSideEncryption": t.sse}
        if t.sse_kms_key_id:
            args["SSEKMSKeyId"] = t.sse_kms_key_id
        return args

    # -- the contract -----------------------------------------------------------------------

    def put(self, sha256: str, source: Path, *, offset: int = 0, length: int | None = None,
            head: bytes = b"") -> Stored:
        """Store the bytes of ``source`` (or its range ``offset``, ``length``, after ``head``) named ``sha256``:
        one PUT up to the target's multipart threshold, else a multipart upload that continues
        an interrupted one. Raises ObjectMismatch when the bytes do not hash to ``sha256``."""
        from pipeline.objectstore import upload

        return upload.put(self, sha256, source, offset=offset, length=length, head=head)

    def presign_put(self, sha256: str, *, expires: int = 900) -> tuple[str, dict[str, str]]:
        """A URL and headers that PUT ``sha256``'s object for ``expires`` seconds, with its
        SHA-256 as a signed ``x-amz-checksum-sha256`` header (the store refuses other bytes):
        what a storage worker uses to put its own copy without credentials (workers/push.py)."""
        key = self.key(sha256)
        params: dict[str, Any] = {"Bucket": self.target.bucket, "Key": key,
                                  "ChecksumSHA256": keys.full_checksum(sha256), **self.sse_args()}
        url = self.call(f"presign of {key}", self.s3.generate_presigned_url, ClientMethod="put_object",
                        Params=params, ExpiresIn=expires)
        headers = {"x-amz-checksum-sha256": keys.full_checksum(sha256)}
        if self.target.sse:
            headers["x-amz-server-side-encryption"] = self.target.sse
            if self.target.sse_kms_key_id:
                headers["x-amz-server-side-encryption-aws-kms-key-id"] = self.target.sse_kms_key_id
        return str(url), headers

    def head(self, sha256: str) -> Stored:
        """The object as the store describes it (ObjectMissing if there is none)."""
        key = self.key(sha256)
        r = self.call(f"head of {key}", self.s3.head_object, Bucket=self.target.bucket, Key=key,
                      ChecksumMode="ENABLED")
        return Stored(key, int(r["ContentLength"]), str(r.get("ChecksumSHA256") or ""))

    def confirm(self, sha256: str, size: int, checksum: str | None = None) -> Stored:
        """Prove from the store's own checksum that it holds ``sha256``'s ``size`` bytes.

        An object sent in one PUT must carry the full-object SHA-256 itself. A multipart
        object's checksum is composite (keys.composite): it must equal ``checksum``, the one
        :meth:`put` returned (the upload hashed the whole source against ``sha256`` in the
        same pass as its parts). Raises ObjectMismatch otherwise, ObjectMissing if absent.
        """
        got = self.head(sha256)
        what = f"confirm of {got.key}"
        if got.size != size:
            raise ObjectMismatch(self.target.name, f"{what}: the store holds {got.size} bytes, expected {size}")
        if not got.checksum:
            raise ObjectMismatch(self.target.name, f"{what}: the store keeps no SHA-256 checksum for it "
                                                   "(written by something else, or tampered with)")
        if keys.is_composite(got.checksum):
            if checksum != got.checksum:
                why = f"is not the expected {checksum}" if checksum else "needs the checksum put returned"
                raise ObjectMismatch(self.target.name, f"{what}: composite checksum {got.checksum} {why}")
        elif got.checksum != keys.full_checksum(sha256):
            raise ObjectMismatch(self.target.name, f"{what}: the store's SHA-256 {got.checksum} is not "
                                                   f"{sha256[:16]}...")
        return got

    def get(self, sha256: str, dest: Path, *, size: int | None = None) -> int:
        """Write the object into ``dest`` (created or truncated) with parallel ranged GETs and
        verify its SHA-256 on the way; returns its size. ObjectMismatch if the bytes differ."""
        from pipeline.objectstore import download

        return download.get(self, sha256, dest, size=size)

    def open(self, sha256: str, size: int) -> download.Stream:
        """The object read in order, its ranges fetched ahead in parallel (download.Stream):
        for a caller that hashes and writes what it reads (a restore)."""
        from pipeline.objectstore import download

        return download.Stream(self, sha256, size)

    def read_back(self, sha256: str, size: int, *, sample: float = 1.0, rate: float = 0.0,
                  seed: int | None = None) -> int:
        """Scrub: read the object back at most ``rate`` bytes/s (0: unthrottled). With
        ``sample`` 1 every byte is read and its SHA-256 checked; below 1, that fraction of its
        ranges (the first and last always) is read and their lengths checked: the object is
        readable and whole, not proven unchanged. Returns the bytes read."""
        from pipeline.objectstore import download

        return download.read_back(self, sha256, size, sample=sample, rate=rate, seed=seed)

    def inventory(self, *, page_size: int = 1000, after: str = "") -> Iterator[Listed]:
        """Every shard under the target's prefix, in key (so hash) order, those named after
        ``after`` only when given (paged listing, ``page_size`` keys a page; other keys are
        skipped). A listing may lag a put on some stores: GC never deletes on it alone."""
        prefix = self.target.prefix
        start = {"StartAfter": self.key(after)} if after else {}
        pages = self.s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.target.bucket, PaginationConfig={"PageSize": page_size},
            **({"Prefix": prefix + "/"} if prefix else {}), **start)
        it = iter(pages)
        while True:
            page = self._next_page(it)
            if page is None:
                return
            for obj in page.get("Contents", []):
                sha = keys.sha_of(prefix, obj["Key"])
                if sha is not None:
                    yield Listed(sha, int(obj["Size"]), obj.get("LastModified"))

    def _next_page(self, pages: Iterator[dict[str, Any]]) -> dict[str, Any] | None:
        def step() -> dict[str, Any] | None:
            return next(pages, None)

        return self.call(f"listing of {self.target.url}", step)

    def delete(self, sha256: str) -> None:
        """Remove the object (absent already: done)."""
        key = self.key(sha256)
        self.call(f"delete of {key}", self.s3.delete_object, Bucket=self.target.bucket, Key=key)

    def used_bytes(self) -> int:
        """Bytes the target's shards take (by listing); capacity is its ``quota_bytes``."""
        return sum(o.size for o in self.inventory())
