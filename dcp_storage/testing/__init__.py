"""Test-support helpers for ``dcp_storage``.

Kept in the package (not in ``tests/``) so that both the repository's own
tests and downstream users can run checkpoint round-trips against a local,
in-memory S3 (:mod:`dcp_storage.testing.s3_server`) and across real
multi-process gloo ranks (:mod:`dcp_storage.testing.distributed`) without
touching the network beyond 127.0.0.1.

Nothing here is imported by the library proper; importing this package is
cheap and pulls in neither torch nor boto3 until a helper is used.
"""
