"""What went wrong with an object store, as one error per cause (pipeline.errors).

botocore retries throttling (503 SlowDown and the other throttling codes) with exponential
backoff from 1 s, and 5xx answers and broken connections from 50 ms, up to the target's
``max_attempts`` (standard retry mode, set in pipeline/objectstore/client.py). What still fails
after that is translated here, so a job can tell "wait and try again, nothing is lost"
(``ObjectStoreError.wait``) from "this copy is bad" without reading botocore's exceptions.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # botocore is the optional s3 extra: imported when a store is used, not before
    from botocore import exceptions as bx

from pipeline.errors import (
    BucketMissing,
    ObjectMismatch,
    ObjectMissing,
    ObjectStoreError,
    StoreCredentials,
    StoreServerError,
    StoreThrottled,
    StoreUnreachable,
)

THROTTLING = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                        "TooManyRequestsException", "RequestThrottled", "BandwidthLimitExceeded",
                        "RequestThrottledException"})
#: Codes by which a store refuses who is asking, as opposed to what is asked.
BAD_CREDENTIALS = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "ExpiredTokenException",
                             "TokenRefreshRequired", "InvalidToken", "InvalidClientTokenId",
                             "AuthorizationHeaderMalformed", "InvalidSecurity", "RequestExpired",
                             "RequestTimeTooSkewed"})
MISMATCH = frozenset({"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "InvalidPart", "IncompleteBody",
                      "InvalidRange"})


def unreachable() -> tuple[type[Exception], ...]:
    """A connection that could not be made or broke (a body cut short included): the store may be fine."""
    from botocore import exceptions as bx

    return (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError, bx.ConnectionClosedError,
            bx.ProxyConnectionError, bx.ResponseStreamingError, bx.IncompleteReadError, bx.HTTPClientError)


def code_of(exc: bx.ClientError) -> tuple[str, int]:
    """The error code and HTTP status of a ClientError (a HEAD's error has only the status)."""
    err = exc.response.get("Error", {})
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return str(err.get("Code") or status), status


def translate(exc: BaseException, target: str, *, credentials: str, what: str,
              bucket_exists: Callable[[], bool | None]) -> ObjectStoreError | None:
    """The ObjectStoreError ``exc`` means, or None when it is none of ours (a bug: let it rise).

    ``credentials`` says where the credentials came from (for the one message a person acts
    on); ``what`` names the request ("put of <key>"); ``bucket_exists`` asks the store (HEAD
    bucket) when an answer is ambiguous: a HEAD has no error body, and some stores answer a PUT
    into a missing bucket with 403 AccessDenied.
    """
    from botocore import exceptions as bx

    if isinstance(exc, ObjectStoreError):
        return exc
    if isinstance(exc, (bx.NoCredentialsError, bx.PartialCredentialsError, bx.ProfileNotFound,
                        bx.CredentialRetrievalError, bx.TokenRetrievalError)):
        return StoreCredentials(target, f"no usable credentials ({exc}); {credentials}")
    if isinstance(exc, unreachable()):
        return StoreUnreachable(target, f"{what}: endpoint unreachable ({exc}); is it up, and is the network to it?")
    if isinstance(exc, bx.ClientError):
        return _client_error(exc, target, credentials=credentials, what=what, bucket_exists=bucket_exists)
    return None


def _client_error(exc: bx.ClientError, target: str, *, credentials: str, what: str,
                  bucket_exists: Callable[[], bool | None]) -> ObjectStoreError:
    code, status = code_of(exc)
    attempts = exc.response.get("ResponseMetadata", {}).get("RetryAttempts", 0)
    if code in THROTTLING or code == "503":  # a HEAD has no body: S3's 503 is SlowDown
        return StoreThrottled(target, f"{what}: throttled ({code}) through {attempts + 1} attempts with backoff")
    if code in BAD_CREDENTIALS:
        return StoreCredentials(target, f"{what}: credentials refused ({code}); {credentials}")
    if code == "NoSuchBucket":
        return BucketMissing(target, f"{what}: the bucket does not exist; create it or fix the target's url")
    if code in MISMATCH:
        return ObjectMismatch(target, f"{what}: the store refused bytes that do not match their checksum ({code})")
    if status == 404 or code in ("AccessDenied", "403", "Forbidden"):
        if bucket_exists() is False:
            return BucketMissing(target, f"{what}: the bucket does not exist; create it or fix the target's url")
        if status == 404:
            return ObjectMissing(target, f"{what}: no such object")
        return StoreCredentials(target, f"{what}: access denied: the credentials were refused, or lack the "
                                        "permission (s3:GetObject, PutObject, ListBucket, DeleteObject on the "
                                        f"bucket); {credentials}")
    if status >= 500:
        return StoreServerError(target, f"{what}: server error {status} ({code}) through {attempts + 1} attempts")
    return ObjectStoreError(target, f"{what}: {code}: {exc.response.get('Error', {}).get('Message', '')}")
