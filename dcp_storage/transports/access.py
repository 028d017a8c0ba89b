"""Access to a store: credential and permission failures as one error, and buckets checked once per save.

Credential and permission failures of a storage call, as one :class:`~dcp_storage.errors.StorageAccessError`.

Each client words them its own way and none names the URL or says where credentials come from:

* botocore: ``NoCredentialsError`` ("Unable to locate credentials"), ``ClientError`` with ``AccessDenied``,
  ``InvalidAccessKeyId``, ``SignatureDoesNotMatch``, ``ExpiredToken`` (s3fs turns these into a bare
  ``PermissionError``);
* gcsfs: ``OSError("Forbidden: <path>\\n<message>")`` for a 403 (its ``validate_response``), ``HttpError``
  with ``code`` 401, google-auth's ``DefaultCredentialsError``/``RefreshError``;
* azure-core (adlfs): ``ClientAuthenticationError`` or ``HttpResponseError`` with ``status_code`` 403 and
  an ``error_code`` such as ``AuthenticationFailed``/``AuthorizationFailure``; azure-identity's
  ``CredentialUnavailableError``.

:func:`access_error` recognises them anywhere along the chain of causes (class names, so that no optional
client library is imported here) and builds our error naming the operation and URL, the store's own reason
(first line only: Azure appends the signature it computed, botocore the request id) and the fix for that
URL's scheme. The transport wraps every storage call in :func:`access_errors`. The retry layer never
retries these (:mod:`.retry`: ``PermissionError`` and 4xx are permanent), so the mapping happens once,
after it.

Buckets and containers: checked once per save, never created unless asked, named when missing.

s3fs's ``makedirs`` creates a missing bucket (gcsfs's and adlfs's ``mkdir`` do too), so a writer that
"makes the checkpoint directory" on an object store turns a typo in the bucket name into a new bucket and
saves there. Object stores have no directories to make, so writers here call :func:`prepare_output`
instead: on the coordinator one existence request for the bucket (S3 ``HeadBucket``, GCS ``GET b/{bucket}``,
Azure container properties), a :class:`~dcp_storage.errors.BucketNotFoundError` naming it if it is missing,
and ``makedirs`` only on filesystems with real directories (local disks, ``memory://``, SFTP...).
``create_bucket=True`` creates a missing bucket for users who want that.

Loads name a missing bucket too: :func:`missing_bucket` is asked on a reader's error path only, after
something was not found, so a healthy load makes no extra request.

A store has buckets when its fsspec filesystem splits paths into ``(bucket, key, version)`` (s3fs, gcsfs,
adlfs: ``split_path``). Transports without an fsspec filesystem (plugins) are left to their own rules.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any

from dcp_storage.errors import BucketNotFoundError, DcpStorageError, StorageAccessError
from dcp_storage.text import mask_credentials, redact_urls, scrub_chain
from dcp_storage.transports.retry import error_chain, error_code, http_status

__all__ = [
    "LOAD_FIX",
    "SAVE_FIX",
    "access_error",
    "access_errors",
    "bucket_of",
    "credentials_fix",
    "make_output_root",
    "missing_bucket",
    "prepare_output",
    "require_bucket",
]


_NO_CREDENTIALS = frozenset(
    {
        "NoCredentialsError",  # botocore: "Unable to locate credentials"
        "PartialCredentialsError",
        "CredentialRetrievalError",
        "DefaultCredentialsError",  # google-auth
        "CredentialUnavailableError",  # azure-identity
    }
)
_REJECTED_CLASSES = frozenset(
    {
        "ClientAuthenticationError",  # azure-core: 401/403 on authentication
        "RefreshError",  # google-auth: a token that cannot be refreshed
        "UnauthenticatedError",  # obstore
    }
)
_DENIED_CLASSES = frozenset({"PermissionDeniedError"})  # obstore
_REJECTED_CODES = frozenset(
    {
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "InvalidToken",
        "TokenRefreshRequired",
        "InvalidClientTokenId",
        "AuthenticationFailed",  # Azure: a wrong account key or SAS
        "InvalidAuthenticationInfo",
        "NoAuthenticationInformation",
    }
)
_DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "AccountProblem",
        "NotSignedUp",
        "AuthorizationFailure",  # Azure (azurite also answers a wrong key with it)
        "AuthorizationPermissionMismatch",
        "InsufficientAccountPermissions",
    }
)
_GCSFS_FORBIDDEN = "Forbidden: "  # gcsfs.retry.validate_response words a 403 as OSError("Forbidden: path\nmsg")
_SCHEME_RE = re.compile(r"\b([a-z][a-z0-9+.-]*)://")
_MAX_REASON = 300

_S3_FIX = (
    "pass credentials in storage_options (key=..., secret=..., and token=... for temporary ones; CLI: "
    "-o key=... -o secret=...), set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) in the "
    "environment, or name a profile (storage_options profile=NAME, CLI: -o profile=NAME, or AWS_PROFILE); "
    "anon=True reads public buckets"
)
_GCS_FIX = (
    "pass a token in storage_options (token=PATH of a service-account JSON file; CLI: -o token=PATH), set "
    "GOOGLE_APPLICATION_CREDENTIALS in the environment, or sign in with `gcloud auth application-default login`; "
    "token='anon' reads public buckets"
)
_AZURE_FIX = (
    "pass account_name with account_key, sas_token or connection_string in storage_options (CLI: "
    "-o account_name=... -o account_key=...), set AZURE_STORAGE_CONNECTION_STRING (or AZURE_STORAGE_ACCOUNT_NAME "
    "and AZURE_STORAGE_ACCOUNT_KEY) in the environment, or sign in (az login) and pass anon=False to use "
    "DefaultAzureCredential"
)
_FIXES = {
    "s3": _S3_FIX,
    "s3a": _S3_FIX,
    "gs": _GCS_FIX,
    "gcs": _GCS_FIX,
    "az": _AZURE_FIX,
    "abfs": _AZURE_FIX,
    "abfss": _AZURE_FIX,
    "adl": _AZURE_FIX,
}
_OTHER_FIX = "pass credentials in storage_options (CLI: -o KEY=VALUE) or through the client's environment variables"
_LOCAL_FIX = "check the permissions of the file and its directories"
_DENIED_HINT = "if the credentials are the right ones, they do not allow this operation: grant it"


def credentials_fix(url: str) -> str:
    """Where credentials for ``url`` come from, as a sentence fragment (no values, ever)."""
    match = _SCHEME_RE.search(url)
    if match is None:
        return _LOCAL_FIX
    return _FIXES.get(match.group(1).lower(), _OTHER_FIX)


def _status(exc: BaseException) -> int | None:
    if isinstance(exc, OSError) and str(exc).startswith(_GCSFS_FORBIDDEN):
        return 403
    return http_status(exc)


def _kind(chain: list[BaseException]) -> str | None:
    """``"missing"``, ``"rejected"``, ``"denied"``, ``"forbidden"`` (a 403 with no reason: the answer to a HEAD
    request has no body), ``"head_400"`` for an access failure; ``None`` for anything else.

    S3 answers an expired or malformed session token (``ExpiredToken``, ``InvalidToken``) and a request
    signed for the wrong region with 400, and to a HEAD request (``HeadObject``, ``HeadBucket``: existence
    and size checks) without a body, so nothing but "400 Bad Request" reaches the client. Our own HEAD
    requests are well formed, so a 400 to one of them is taken for such a refusal.

    The most specific evidence anywhere along the chain wins: s3fs's bare ``PermissionError`` on top says
    less than the botocore error code below it.
    """
    names = {cls.__name__ for exc in chain for cls in type(exc).__mro__}
    codes = {error_code(exc) for exc in chain}
    statuses = {_status(exc) for exc in chain}
    if names & _NO_CREDENTIALS:
        return "missing"
    if codes & _REJECTED_CODES or names & _REJECTED_CLASSES:
        return "rejected"
    if codes & _DENIED_CODES or names & _DENIED_CLASSES:
        return "denied"
    if 401 in statuses:
        return "rejected"
    if 403 in statuses or any(isinstance(exc, PermissionError) for exc in chain):
        return "forbidden"
    if any(_status(exc) == 400 and str(getattr(exc, "operation_name", "")).startswith("Head") for exc in chain):
        return "head_400"
    return None


def _message(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        message = response.get("Error", {}).get("Message")
        if isinstance(message, str) and message:
            return message
    text = str(exc)
    if text.startswith(_GCSFS_FORBIDDEN) and "\n" in text:
        text = text.split("\n", 1)[1]  # the first line is just gcsfs's path
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def _reason(chain: list[BaseException]) -> str:
    """The store's own words: ``Code: message`` from the exception closest to the client that has a code."""
    code = next((c for c in map(error_code, chain) if c), None)
    source = next((e for e in reversed(chain) if error_code(e)), chain[-1])
    message = _message(source)
    reason = message if code is None or code in message else f"{code}: {message}"
    if code is None:
        status = next((s for s in map(_status, chain) if s), None)
        reason = f"HTTP {status}: {message}" if status else f"{type(source).__name__}: {message}"
    reason = mask_credentials(reason)
    return reason if len(reason) <= _MAX_REASON else reason[: _MAX_REASON - 3] + "..."


_PHRASES = {
    "missing": "no credentials were found",
    "rejected": "the store rejected the credentials",
    "denied": "access denied",
    "forbidden": "the store refused the request (wrong credentials, or credentials without this permission)",
    "head_400": (
        "the store refused the request (400 with no reason, as HEAD requests get it: usually an expired or invalid "
        "session token, or credentials for another region)"
    ),
}


def access_error(exc: BaseException, what: str) -> StorageAccessError | None:
    """Our error for ``exc`` if it (or a cause) is a credential or permission failure, else ``None``.

    ``what`` names the operation and its URL (``"read s3://b/ckpt/.metadata"``): the transport's own
    description of the call.
    """
    if isinstance(exc, DcpStorageError):
        return None  # ours already, named and explained
    chain = list(error_chain(exc))
    kind = _kind(chain)
    if kind is None:
        return None
    fix = credentials_fix(what)
    if kind in ("denied", "forbidden") and fix != _LOCAL_FIX:
        fix = f"{_DENIED_HINT}; otherwise {fix}"
    return StorageAccessError(f"{what}: {_PHRASES[kind]} ({_reason(chain)}); {fix}")


@contextlib.contextmanager
def access_errors(describe: Callable[[], str]) -> Iterator[None]:
    """Raise :func:`access_error`'s error (chained) in place of a credential or permission failure."""
    try:
        yield
    except Exception as exc:
        mapped = access_error(exc, describe())
        scrub_chain(exc)  # a presigned URL's secrets in a client's error: masked, or that error cut off
        if mapped is None:
            raise
        if redact_urls(str(exc)) != str(exc):
            raise mapped from None
        raise mapped from exc


_CONTAINER_PROTOCOLS = frozenset({"az", "abfs", "abfss", "adl"})
LOAD_FIX = "check the {noun} name in the URL, and the endpoint or account in storage_options"
SAVE_FIX = (
    "check the {noun} name in the URL; writers never create buckets or containers: create it first, or pass "
    "create_bucket=True (--create-bucket)"
)


def bucket_of(transport: Any, path: str) -> str | None:
    """The bucket (Azure: container) ``path`` lies in, or ``None`` for a store without buckets."""
    split = getattr(getattr(transport, "fs", None), "split_path", None)
    if not callable(split):
        return None
    try:
        bucket = split(path)[0]
    except (ValueError, TypeError, IndexError):
        return None
    return bucket if isinstance(bucket, str) and bucket else None


def _noun(transport: Any) -> str:
    protocol = getattr(transport.fs, "protocol", "")
    names = protocol if isinstance(protocol, (tuple, list)) else (protocol,)
    return "container" if _CONTAINER_PROTOCOLS & set(names) else "bucket"


def missing_bucket(transport: Any, path: str, fix: str = LOAD_FIX) -> BucketNotFoundError | None:
    """The error for ``path`` if its bucket does not exist (one request); ``None`` if it does or has none.

    ``fix`` may name the ``{noun}`` (``bucket`` or ``container``).
    """
    bucket = bucket_of(transport, path)
    if bucket is None or transport.exists(bucket):
        return None
    noun = _noun(transport)
    return BucketNotFoundError(transport.url(path), bucket, noun, fix.format(noun=noun))


def require_bucket(transport: Any, path: str, *, create: bool = False) -> None:
    """Raise :class:`BucketNotFoundError` if ``path``'s bucket is missing; with ``create``, create it instead.

    Credentials that may write objects but not ask about the bucket (S3 ``HeadBucket`` needs
    ``s3:ListBucket``) get a 403: the bucket's existence is then unknown, and the save goes on (its next
    request tells what is wrong, with a body that says why, where a HEAD answer has none).
    """
    try:
        error = missing_bucket(transport, path, SAVE_FIX)
    except StorageAccessError:
        return
    if error is None:
        return
    if not create:
        raise error
    with (
        access_errors(lambda: f"create {error.noun} {transport.url(error.bucket)}"),
        contextlib.suppress(
            FileExistsError  # another process created it meanwhile
        ),
    ):
        transport.fs.mkdir(error.bucket)


def make_output_root(transport: Any, root: str) -> None:
    """Create the output directory where directories exist; on object stores there is nothing to make."""
    if bucket_of(transport, root) is None:
        transport.makedirs(root)


def prepare_output(transport: Any, root: str, *, coordinator: bool, create_bucket: bool = False) -> None:
    """A writer's set-up for ``root``: the bucket checked (or created) by the coordinator, directories made."""
    if coordinator:
        require_bucket(transport, root, create=create_bucket)
    make_output_root(transport, root)
