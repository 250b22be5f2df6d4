"""The store's one error type, what an object store's failures mean, and bounded retries of the transient ones.

Every call a `ModuleStore` makes on a remote filesystem (s3://, gs://, ...) goes through
`RetryingFileSystem`: a failure to reach the server (connection refused or reset, a timeout) is retried
`ATTEMPTS` times in all with exponential backoff (`BACKOFF` s, doubling) and then becomes a `StoreError`
naming the URL; failures no retry can mend (no credentials, access denied, a missing bucket) become a
`StoreError` at once, saying what to fix. A missing *file* stays a `FileNotFoundError`: callers use it.

    fs = RetryingFileSystem(fsspec.filesystem("s3"), url="s3://bucket/run")
    fs.cat_file("bucket/run/state.json")   # StoreError("store s3://bucket/run: cannot reach ...") when down

Credentials and endpoints come from the environment, never from the run's config (which is published
in the store): AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ... (docs/islands.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

ATTEMPTS = 4  # tries of one store call in all (the backend's own retries happen inside each)
BACKOFF = 0.5  # seconds before the second try; doubled before each next one

# Exception class names (anywhere in the MRO) of the backends' "could not reach the server" errors:
# botocore / aiohttp (s3fs), google-auth / aiohttp (gcsfs), plus the builtins.
_TRANSIENT = {"ConnectionError", "TimeoutError", "EndpointConnectionError", "ConnectTimeoutError",
              "ReadTimeoutError", "ClientConnectionError", "ClientConnectorError", "ServerDisconnectedError",
              "ClientPayloadError", "ResponseStreamingError", "ProxyConnectionError"}
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"}
_ENV_HINT = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE / ~/.aws/credentials), and "
          "AWS_ENDPOINT_URL for a server other than AWS",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS (or run `gcloud auth application-default login`)",
}


class LeaseLost(RuntimeError):
    """This coordinator's lease was taken over: it must not write to the store again (`dipaco.store.lease`);
    also raised when a commit is refused because another coordinator fenced `state.json`."""


class StoreError(RuntimeError):
    """A store file is missing, corrupt or of an unknown version, or the store cannot be reached."""


def _names(err: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(err).__mro__}


def is_transient(err: BaseException) -> bool:
    """A failure to reach the server, which a later try may not meet."""
    if isinstance(err, (FileNotFoundError, PermissionError)):
        return False
    return bool(_names(err) & _TRANSIENT)


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


def permanent_error(err: BaseException, *, url: str) -> StoreError | None:
    """The `StoreError` for a failure no retry mends, or None when `err` is not one."""
    hint = _ENV_HINT.get(protocol_of(url), "check the credentials this process sees")
    if _names(err) & _NO_CREDENTIALS:
        return StoreError(f"store {url}: no credentials ({err}); {hint}")
    if isinstance(err, PermissionError):
        return StoreError(f"store {url}: access denied ({err}); {hint}, with read and write access to it")
    if isinstance(err, FileNotFoundError) and "bucket" in str(err).lower():
        return StoreError(f"store {url}: {missing_bucket(url)} ({err})")
    return None


def missing_bucket(url: str) -> str:
    bucket = url.split("://", 1)[-1].split("/", 1)[0]
    return (f"the bucket {bucket!r} does not exist (or these credentials cannot see it): create it "
            f"(e.g. `aws s3 mb s3://{bucket}`) or fix store.url / --store")


def retrying(call: Callable[..., Any], *, url: str, what: str) -> Callable[..., Any]:
    """`call`, retried on transient failures and with permanent ones turned into a `StoreError`."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return call(*args, **kwargs)
            except Exception as err:
                known = permanent_error(err, url=url)
                if known is not None:
                    raise known from None
                if not is_transient(err):
                    raise
                if attempt == ATTEMPTS:
                    raise StoreError(f"store {url}: cannot reach the server ({type(err).__name__}: {err}) after "
                                     f"{ATTEMPTS} tries of {what}; check that it runs and its address "
                                     f"(AWS_ENDPOINT_URL for S3-compatible servers)") from None
                pause = BACKOFF * 2 ** (attempt - 1)
                log.warning("store %s: %s failed (%s: %s); try %d of %d in %.1fs", url, what, type(err).__name__,
                            err, attempt + 1, ATTEMPTS, pause)
                time.sleep(pause)
        raise AssertionError("unreachable")

    return wrapped


class RetryingFileSystem:
    """An fsspec filesystem whose public methods go through `retrying` (attributes pass through)."""

    def __init__(self, fs: Any, *, url: str):
        self._fs, self._url = fs, url

    @property
    def wrapped(self) -> Any:
        """The filesystem itself."""
        return self._fs

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if name.startswith("_") or not callable(attr):
            return attr
        return retrying(attr, url=self._url, what=name)


def check_reachable(fs: Any, root: str, *, url: str) -> None:
    """Refuse a remote store whose bucket is missing, or that cannot be reached, before any work (a
    `StoreError` saying what to fix). Local directories are always reachable (they are made on write)."""
    if _lacks_credentials(url):
        raise StoreError(f"store {url}: no credentials found; {_ENV_HINT['s3']}")
    bucket = root.split("/", 1)[0]
    backend = fs.wrapped if isinstance(fs, RetryingFileSystem) else fs
    try:
        if hasattr(backend, "call_s3"):  # s3fs: HEAD the bucket (exists() would hide why it failed)
            retrying(backend.call_s3, url=url, what="head_bucket")("head_bucket", Bucket=bucket)
            return
        found = fs.exists(bucket)
    except StoreError:
        raise
    except FileNotFoundError:
        found = False
    except Exception as err:  # the backend's own error types
        raise permanent_error(err, url=url) or StoreError(f"store {url}: {type(err).__name__}: {err}") from None
    if not found:
        raise StoreError(f"store {url}: {missing_bucket(url)}")


def _lacks_credentials(url: str) -> bool:
    """An s3:// store for which botocore finds no credentials (environment, profile, instance role) and
    fsspec's configuration gives none (FSSPEC_S3_KEY / FSSPEC_S3='{"key": ...}' or anonymous access)."""
    if protocol_of(url) not in ("s3", "s3a"):
        return False
    import fsspec.config

    options = fsspec.config.conf.get("s3", {})
    if options.get("key") or options.get("anon") or options.get("profile"):
        return False
    try:
        import botocore.session
    except ImportError:
        return False
    return botocore.session.get_session().get_credentials() is None
