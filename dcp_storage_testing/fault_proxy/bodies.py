"""The error responses :class:`~dcp_storage_testing.fault_proxy.FaultProxy` answers with, per store dialect.

Each is what the real store sends, so clients parse them exactly as they would in production: S3 XML
(``<Error><Code>...``, which botocore turns into ``SlowDown``/``InternalError``/``AccessDenied``) or the GCS
JSON API's ``{"error": {"code", "message", "errors": [{"reason"}]}}`` (which gcsfs reads).
"""

from __future__ import annotations

import json

__all__ = ["ANSWERED_MODES", "error_body"]

_S3_ERRORS = {
    "slowdown_503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "error_500": (500, "Internal Server Error", "InternalError", "We encountered an internal error. Please try again."),
    "forbidden_403": (403, "Forbidden", "AccessDenied", "Access Denied"),
}
_GCS_ERRORS = {
    "slowdown_503": (503, "Slow Down", "backendError", "Please reduce your request rate."),
    "error_500": (500, "Internal Server Error", "backendError", "We encountered an internal error. Please try again."),
    "forbidden_403": (
        403,
        "Forbidden",
        "forbidden",
        "fault-proxy@example.iam.gserviceaccount.com does not have storage.objects.get access to the object.",
    ),
}


# Modes the proxy answers itself, with an error, never forwarding the request.
ANSWERED_MODES = frozenset(_S3_ERRORS)


def error_body(mode: str, dialect: str) -> tuple[int, str, bytes, str]:
    """``(status, reason phrase, body, content type)`` of the answer to a request faulted in ``mode``."""
    if dialect == "gcs":
        status, phrase, reason, message = _GCS_ERRORS[mode]
        payload = {"error": {"code": status, "message": message, "errors": [{"message": message, "reason": reason}]}}
        return status, phrase, json.dumps(payload).encode(), "application/json; charset=UTF-8"
    status, phrase, code, message = _S3_ERRORS[mode]
    xml = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
        "<RequestId>fault-proxy</RequestId></Error>"
    )
    return status, phrase, xml.encode(), "application/xml"
