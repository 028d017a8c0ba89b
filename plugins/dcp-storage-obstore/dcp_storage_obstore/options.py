"""Turning the project's s3fs-style ``storage_options`` into obstore ``S3Store`` settings.

Users switch transports by adding ``{"transport": "obstore"}`` to the options they already pass to the
s3fs transport, so this module accepts that dict (``key``, ``secret``, ``token``, ``anon``,
``endpoint_url``, ``client_kwargs.{endpoint_url, region_name, aws_*}``) and maps it. s3fs-only caching
switches are accepted and ignored; anything else is refused by name (never by value, which may be a
secret), because silently dropping an option such as ``requester_pays`` would read from the wrong place.
obstore's own settings can be given under ``obstore``: ``{"config": {...}, "client_options": {...}}``.

The result keeps credentials out of ``repr`` so that neither a transport nor an error message shows them.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dcp_storage.plugin_api import DcpStorageError

__all__ = ["ObstoreOptionsError", "S3Settings", "s3_settings"]

# s3fs options that only steer s3fs's own caches or event loop: meaningless here, harmless to drop.
_IGNORED = frozenset(
    {
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
        "default_block_size",
        "default_fill_cache",
        "default_cache_type",
        "asynchronous",
        "loop",
        "cache_regions",
        "version_aware",
    }
)
_TOP_LEVEL = {"key": "access_key_id", "secret": "secret_access_key", "token": "session_token"}
_CLIENT_KWARGS = {
    "aws_access_key_id": "access_key_id",
    "aws_secret_access_key": "secret_access_key",
    "aws_session_token": "session_token",
    "region_name": "region",
}
_SECRET_KEYS = frozenset({"secret_access_key", "session_token"})
# One request may stream up to max_request_bytes; object_store's default 30 s whole-request timeout is
# too short for a slow link, so the default here is generous (users override via obstore.client_options).
# A request never outlives its operation's deadline, though: see S3Settings.store_kwargs.
DEFAULT_REQUEST_TIMEOUT_S = 300.0
_DEFAULT_CLIENT_OPTIONS = {"timeout": f"{DEFAULT_REQUEST_TIMEOUT_S:g}s", "connect_timeout": "10s"}


class ObstoreOptionsError(DcpStorageError, ValueError):
    """A storage option the obstore transport cannot honour (the message names the option, not its value)."""


@dataclass(frozen=True)
class S3Settings:
    """Everything needed to build an ``S3Store`` for any bucket, secrets hidden from ``repr``."""

    config: dict[str, Any] = field(repr=False)
    client_options: dict[str, Any] = field(repr=False)
    endpoint: str | None = None
    region: str | None = None

    def store_kwargs(self, bucket: str, deadline: float | None = None) -> dict[str, Any]:
        """Keyword arguments for ``obstore.store.S3Store`` (``retry_config`` is added by the caller).

        ``deadline`` is the retry policy's bound on a whole operation. Unless the user set a ``timeout`` of
        their own, each request's whole-request timeout is the smaller of it and the default: a server that
        holds back its headers or stops in mid-body raises no error, so without this one attempt lasted the
        full default whatever the deadline said (the core bounds its fsspec requests the same way).
        """
        client_options = dict(self.client_options)
        if deadline is not None and client_options.get("timeout") == _DEFAULT_CLIENT_OPTIONS["timeout"]:
            client_options["timeout"] = datetime.timedelta(seconds=min(DEFAULT_REQUEST_TIMEOUT_S, deadline))
        return {"bucket": bucket, "config": dict(self.config), "client_options": client_options}

    def public_config(self) -> dict[str, Any]:
        """The config with secret values masked, for logs and benchmark records."""
        return {k: ("***" if k in _SECRET_KEYS else v) for k, v in self.config.items()}


def s3_settings(storage_options: Mapping[str, Any] | None) -> S3Settings:
    """Map s3fs-style ``storage_options`` onto obstore S3 settings; refuse what cannot be mapped."""
    options = dict(storage_options or {})
    config: dict[str, Any] = {}
    client_options: dict[str, Any] = dict(_DEFAULT_CLIENT_OPTIONS)
    unknown: list[str] = []
    for name, value in options.items():
        if name in _IGNORED:
            continue
        if name in _TOP_LEVEL:
            if value is not None:
                config[_TOP_LEVEL[name]] = str(value)
        elif name == "anon":
            if value:
                config["skip_signature"] = True
        elif name == "endpoint_url":
            _set_endpoint(config, client_options, value)
        elif name == "use_ssl":
            if value is False:
                client_options["allow_http"] = True
        elif name == "client_kwargs":
            unknown += _client_kwargs(value, config, client_options)
        elif name == "obstore":
            unknown += _passthrough(value, config, client_options)
        else:
            unknown.append(name)
    if unknown:
        raise ObstoreOptionsError(
            "the obstore transport cannot map storage option(s) "
            + ", ".join(repr(n) for n in sorted(unknown))
            + "; supported: key, secret, token, anon, endpoint_url, use_ssl, client_kwargs.{endpoint_url, "
            "region_name, aws_access_key_id, aws_secret_access_key, aws_session_token}, and obstore settings "
            "under 'obstore': {'config': {...}, 'client_options': {...}}"
        )
    return S3Settings(config, client_options, endpoint=config.get("endpoint"), region=config.get("region"))


def _set_endpoint(config: dict[str, Any], client_options: dict[str, Any], url: Any) -> None:
    if url is None:
        return
    url = str(url)
    config["endpoint"] = url
    if url.startswith("http://"):
        client_options["allow_http"] = True


def _client_kwargs(value: Any, config: dict[str, Any], client_options: dict[str, Any]) -> list[str]:
    if not isinstance(value, Mapping):
        raise ObstoreOptionsError(f"storage option 'client_kwargs' must be a dict, got {type(value).__name__}")
    unknown = []
    for name, item in value.items():
        if name == "endpoint_url":
            _set_endpoint(config, client_options, item)
        elif name in _CLIENT_KWARGS:
            if item is not None:
                config[_CLIENT_KWARGS[name]] = str(item)
        else:
            unknown.append(f"client_kwargs.{name}")
    return unknown


def _passthrough(value: Any, config: dict[str, Any], client_options: dict[str, Any]) -> list[str]:
    if not isinstance(value, Mapping):
        raise ObstoreOptionsError(f"storage option 'obstore' must be a dict, got {type(value).__name__}")
    unknown = []
    for name, item in value.items():
        if name == "config" and isinstance(item, Mapping):
            config.update(item)
        elif name == "client_options" and isinstance(item, Mapping):
            client_options.update(item)
        else:
            unknown.append(f"obstore.{name}")
    return unknown
