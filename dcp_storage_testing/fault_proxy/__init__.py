"""A fault-injecting HTTP/1.1 reverse proxy for tests: put it between a client and an emulator.

Object stores throttle, fail, reset connections and cut bodies short; emulators (moto, fake-gcs-server)
do none of that. :class:`FaultProxy` listens on ``127.0.0.1`` (port 0, read back), forwards every request
*verbatim* to one upstream (request line, headers including ``Host``, body bytes), and on the requests its
:class:`FaultRule` s select, misbehaves in one of these ways (:data:`FAULT_MODES`, any request):

``slowdown_503``
    ``503`` with an S3 ``SlowDown`` XML body (or, with ``dialect="gcs"``, a GCS JSON error); upstream
    never sees the request.
``error_500``
    ``500 InternalError``, likewise never forwarded.
``reset``
    A TCP reset before any response byte (``SO_LINGER`` 0, then close); never forwarded.
``truncate``
    Forwarded; the client gets the upstream's headers (full ``Content-Length``) and half of the body, then
    a reset. The upstream *did* act on the request, as a real store may have before a connection dies.
``slow``
    Forwarded; the response is held back for ``delay`` seconds (a client with a shorter read timeout gives
    up; the upstream acted on the request either way).

and one that only a deadline ends (:data:`STALL_MODES`):

``stall_body``
    Forwarded; the client gets the upstream's headers and half of the body, then nothing for ``delay``
    seconds on a connection that stays open (then a reset). No socket error comes in the meantime.

``trickle_body``
    Forwarded; the client gets the headers and half of the body, then one byte every ``delay`` seconds until
    the body ends: each wait is short, the whole is not.

and one refusal no retry gets past (:data:`PERMANENT_MODES`):

``forbidden_403``
    ``403`` with the body the real store sends for credentials that lack a permission (S3 ``AccessDenied``
    XML; GCS JSON, ``reason: forbidden``); never forwarded. Emulators that check no credentials
    (fake-gcs-server) get their 403s this way.

and, on ranged GETs only (a single range in ``Range``, or in Azure's ``x-ms-range``;
:data:`RANGE_FAULT_MODES`), as a server or a cache in between that mishandles ranges may: a well-formed
answer with other bytes than were asked for. The request goes upstream with its range changed, and the
answer comes back as the store gave it. moto and fake-gcs-server do not check request signatures; azurite
does, so reach it with a SAS (which signs the URL, not the headers).

``ignore_range``
    ``Range`` dropped: ``200`` and the whole object.
``shift_range``
    As many bytes, one byte down (up, for a range from 0): a ``206`` whose ``Content-Range`` names them.
``short_range``
    The first half of the range: a complete ``206`` with that ``Content-Range`` and ``Content-Length``.

and two that keep the store's ``206`` head, its ``Content-Range`` naming exactly the range asked for, and
change the body (:data:`BODY_FAULT_MODES`), as a compressing or broken cache in between may:

``encoded_range``
    The body gzip-encoded, with ``Content-Encoding: gzip``; when the range is long enough (about 40 bytes),
    the encoding is padded (a gzip comment) to exactly the range's length, so ``Content-Length`` stays
    what the range asks for, and it decodes to as many zero bytes, not the stored ones. A client that
    decodes (aiohttp) or one that does not (botocore) then holds the right number of wrong bytes.
``long_range``
    ``Transfer-Encoding: chunked`` without ``Content-Length``, and 16 zero bytes before the range's bytes:
    a body longer than its ``Content-Range``, whose first ``end - start`` bytes are not the range.

Why a byte-level proxy rather than an HTTP framework: S3 SigV4 signs the ``Host`` header, so the client
must talk to the proxy's address and the proxy must pass the head on untouched; and resets and truncated
bodies need control of the socket that frameworks hide. Bodies are streamed in 64 KiB pieces, never
buffered whole.

It runs an asyncio loop in a daemon thread, so synchronous tests and pytest fixtures use it directly::

    with FaultProxy(moto.endpoint_url) as proxy:
        proxy.set_rules([FaultRule("truncate", every=3, method="GET")])
        ...  # point the client's endpoint_url at proxy.url
        assert proxy.counters().faults["truncate"] > 0

``FaultProxy(upstream, link=LinkModel(bytes_per_s=25e6, first_byte_s=0.03))`` also models a real store's
network: a bandwidth cap per connection and a latency before each response (:mod:`.link`); the write
benchmark puts it in front of moto (``--s3-link``).

Rules can be replaced at any time from any thread (:meth:`FaultProxy.set_rules`); :meth:`counters`
returns a consistent snapshot.
"""

from dcp_storage_testing.fault_proxy.link import LinkModel, Pacer
from dcp_storage_testing.fault_proxy.proxy import FaultProxy, FaultProxyError
from dcp_storage_testing.fault_proxy.rules import (
    ALL_FAULT_MODES,
    BODY_FAULT_MODES,
    CONDITION_FAULT_MODES,
    CORRUPT_BODY_MODES,
    FAULT_MODES,
    PERMANENT_MODES,
    RANGE_FAULT_MODES,
    STALL_MODES,
    FaultCounters,
    FaultMode,
    FaultRule,
)

__all__ = [
    "ALL_FAULT_MODES",
    "BODY_FAULT_MODES",
    "CONDITION_FAULT_MODES",
    "CORRUPT_BODY_MODES",
    "FAULT_MODES",
    "PERMANENT_MODES",
    "RANGE_FAULT_MODES",
    "STALL_MODES",
    "FaultCounters",
    "FaultMode",
    "FaultProxy",
    "FaultProxyError",
    "FaultRule",
    "LinkModel",
    "Pacer",
]
