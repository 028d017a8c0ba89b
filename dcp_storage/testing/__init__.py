"""Test-support helpers for ``dcp_storage``.

Kept in the package (not in ``tests/``) so that both the repository's own
tests and downstream users can run checkpoint round-trips against a local,
in-memory S3 (:mod:`dcp_storage.testing.s3_server`) and across real
multi-process gloo ranks (:mod:`dcp_storage.testing.distributed`) without
any network traffic beyond 127.0.0.1.

Nothing in the library proper imports this package, and it imports nothing
eagerly: each helper module defers its heavy imports (boto3, torch) to first use.
"""
