"""HTTP redirects to another origin are refused, so a checkpoint's credentials never leave for another host.

aiohttp (under fsspec's HTTP filesystem) follows redirects and, to another origin, drops only
``Authorization`` and cookies: an API-key header from ``storage_options`` (``headers={"X-Api-Key": ...}``)
goes along to whatever host the ``Location`` names, and that host's bytes are loaded as the checkpoint's.
So every HTTP session the transport uses gets a redirect hook (an aiohttp trace callback, run before the
redirect is followed) that compares the origins (scheme, host, port: another port is another origin):

* the same origin: followed as before (a server that moves files within itself keeps working);
* another origin: :class:`~dcp_storage.errors.CrossOriginRedirectError` naming both URLs (secrets masked),
  raised before any request goes there; not retried;
* another origin with the storage option ``cross_origin_redirects="follow-without-credentials"``: followed
  with only the request's own range and condition headers; every header from ``storage_options``
  (``Authorization``, ``X-Api-Key``, cookies, ...) is dropped first.

The hook is installed through fsspec's ``get_client`` option with a module-level function, so the
filesystem still pickles (a process-mode save or a rank process rebuilds it).
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from dcp_storage.errors import CrossOriginRedirectError
from dcp_storage.redaction import redact_urls

__all__ = ["REDIRECT_OPTION", "guarded_client", "http_redirect_options"]

REDIRECT_OPTION = "cross_origin_redirects"  # storage option: "refuse" (the default) or FOLLOW
FOLLOW = "follow-without-credentials"
_CHOICES = ("refuse", FOLLOW)
# What a request of ours carries of its own; everything else came from storage_options and stays home.
_OWN_HEADERS = frozenset({"range", "accept-encoding", "if-match", "accept", "user-agent", "host"})


def http_redirect_options(url: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for fsspec's HTTP filesystem with the redirect hook; other schemes: the option removed."""
    options = dict(options)
    choice = options.pop(REDIRECT_OPTION, "refuse")
    if choice not in _CHOICES:
        raise ValueError(f"storage option {REDIRECT_OPTION}={choice!r}: expected one of {', '.join(_CHOICES)}")
    if url.split("://", 1)[0].lower() not in ("http", "https"):
        return options
    inner = options.get("get_client")
    options["get_client"] = functools.partial(guarded_client, inner=inner, follow=choice == FOLLOW)
    return options


async def guarded_client(
    inner: Callable[..., Awaitable[Any]] | None = None, follow: bool = False, **kwargs: Any
) -> Any:
    """fsspec's ``get_client``: ``inner(**kwargs)`` (or a plain ``aiohttp.ClientSession``) with the hook."""
    import aiohttp  # fsspec's HTTP filesystem needs it; imported only when an HTTP session is made

    trace = aiohttp.TraceConfig()
    trace.on_request_redirect.append(functools.partial(_on_redirect, follow=follow))
    kwargs["trace_configs"] = [*(kwargs.get("trace_configs") or []), trace]
    if inner is not None:
        return await inner(**kwargs)
    return aiohttp.ClientSession(**kwargs)


async def _on_redirect(_session: Any, _context: Any, params: Any, *, follow: bool) -> None:
    """Before aiohttp follows a redirect: same origin, go on; another origin, refuse (or strip, see module)."""
    from yarl import URL  # aiohttp's URL type

    here = URL(str(params.url))
    location = params.response.headers.get("Location") or params.response.headers.get("URI")
    if not location:
        return
    target = here.join(URL(location))
    if target.origin() == here.origin():
        return
    if follow:
        for name in [n for n in params.headers if n.lower() not in _OWN_HEADERS]:
            params.headers.popall(name, None)
        return
    raise CrossOriginRedirectError(
        f"{redact_urls(str(here))} redirected to another origin, {redact_urls(str(target))}: refused, so the "
        "checkpoint's credentials and headers are not sent there and its bytes are not loaded. Use the target URL "
        f"directly if you trust it, or pass storage option {REDIRECT_OPTION}={FOLLOW!r} to follow such redirects "
        "without any header from storage_options"
    )
