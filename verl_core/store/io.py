"""How the run store meets storage: the mapping of I/O failures to the project's error families
(:func:`_io`, with the checks every call runs first), and the fsspec options of a store URL."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import Callable, Optional

from verl_core.errors import (PermanentError, StoreFullError, StoreUnavailableError,
                              VerlError)


class NotFoundError(PermanentError):
    """A named doc (or object) does not exist in the store."""


class StorePermissionError(PermanentError):
    """The store refused access (credentials, bucket policy, file permissions)."""



def _transient_types() -> tuple[type, ...]:
    """The errors of an outage. aiohttp's only once something imported aiohttp (s3fs, for an S3
    store): none of its errors can exist before, and its import would cost every process, most
    of which never reach S3, ~0.3 s of CPU; so this is evaluated when an error is being mapped,
    not when this module is imported."""
    types: list[type] = [ConnectionError, TimeoutError]
    with contextlib.suppress(ImportError):
        import botocore.exceptions as be

        types.append(be.BotoCoreError)  # EndpointConnectionError, ReadTimeoutError, ...
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        types.append(aiohttp.ClientError)
    with contextlib.suppress(ImportError):
        from fsspec.exceptions import FSTimeoutError

        types.append(FSTimeoutError)
    return tuple(types)


def _credential_types() -> tuple[type, ...]:
    try:
        import botocore.exceptions as be
    except ImportError:
        return ()
    return (be.NoCredentialsError, be.PartialCredentialsError)


# Missing S3 credentials are a configuration problem, not an outage: retrying cannot fix them.
_CREDENTIALS = _credential_types()


_BEFORE_IO: list[Callable[[str], None]] = []
"""Checks every run-store call makes first, each called with what the call is about to do; one
may raise (a store outage drill: :mod:`verl_core.guard.faults` adds it). The store does not know
what they are, so it imports nothing above it."""


def before_io(check: Callable[[str], None]) -> None:
    """Add ``check`` to what every run-store call runs first (once, however often it is added)."""
    if check not in _BEFORE_IO:
        _BEFORE_IO.append(check)


@contextlib.contextmanager
def _io(what: str, *, missing_ok: bool = False):
    """Map an I/O failure during ``what`` to the project's error families.

    FileNotFoundError passes through (callers decide whether "missing" is corruption or normal);
    permission problems are permanent; everything else network/OS-like is transient."""
    for check in _BEFORE_IO:
        check(what)
    try:
        yield
    except VerlError:
        raise
    except FileNotFoundError:
        raise
    except PermissionError as e:
        raise StorePermissionError(f"{what}: permission denied ({e})") from e
    except _CREDENTIALS as e:
        raise StorePermissionError(
            f"{what}: no S3 credentials ({type(e).__name__}: {e}); set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or an IAM role), or pass storage_options "
            "key/secret") from e
    except (IsADirectoryError, NotADirectoryError) as e:
        raise PermanentError(f"{what}: {e}") from e
    except _transient_types() as e:
        raise StoreUnavailableError(f"{what}: store unavailable ({type(e).__name__}: {e})") from e
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StoreFullError(
                f"{what}: the store is full ({e}); free space, keep fewer checkpoints "
                "(checkpoint.keep_last) or delete unreferenced objects with "
                "`python -m verl_core.checkpoint gc <store>`; no committed checkpoint was "
                "changed") from e
        raise StoreUnavailableError(f"{what}: I/O error ({type(e).__name__}: {e})") from e


def resolve_storage_options(url: str, storage_options: Optional[dict] = None) -> dict:
    """The fsspec options every call of a run makes for ``url`` with: for S3 the endpoint from
    ``$VERL_S3_ENDPOINT``/``$AWS_ENDPOINT_URL`` and the client timeouts (:func:`_s3_options`),
    for anything else ``storage_options`` as given. Idempotent, so options a :class:`RunStore`
    already resolved (its ``storage_options``) can pass through again unchanged.

    Why one function: botocore knows nothing of ``VERL_S3_ENDPOINT``, so an fsspec call built
    from the caller's raw options reaches the default AWS endpoint instead of the configured
    server (issue 21: finalize sent the final model there)."""
    protocol = url.split("://", 1)[0] if isinstance(url, str) and "://" in url else "file"
    opts = dict(storage_options or {})
    return _s3_options(opts) if protocol in ("s3", "s3a") else opts


def _s3_options(storage_options: dict) -> dict:
    """Default endpoint (from env) and short timeouts for s3fs, unless the caller chose them."""
    opts = dict(storage_options)
    endpoint = os.environ.get("VERL_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL")
    client_kwargs = dict(opts.get("client_kwargs") or {})
    if endpoint and "endpoint_url" not in opts and "endpoint_url" not in client_kwargs:
        client_kwargs["endpoint_url"] = endpoint
    if client_kwargs:
        opts["client_kwargs"] = client_kwargs
    config = dict(opts.get("config_kwargs") or {})
    config.setdefault("connect_timeout", 10)
    config.setdefault("read_timeout", 60)
    config.setdefault("retries", {"max_attempts": 3, "mode": "standard"})
    opts["config_kwargs"] = config
    # Listings must see other processes' writes (checkpoint index, logs): no dircache.
    opts.setdefault("use_listings_cache", False)
    opts.setdefault("skip_instance_cache", True)
    return opts
