"""Test-support helpers for ``dcp_storage``.

Kept in the package (not in ``tests/``) so that both the repository's own
tests and downstream users can run checkpoint round-trips without any network
traffic beyond 127.0.0.1:

* emulators started as subprocesses on free ports: in-memory S3 (moto,
  :mod:`~dcp_storage_testing.s3_server`; s3rver for benchmarks,
  :mod:`~dcp_storage_testing.s3rver`), GCS (fake-gcs-server,
  :mod:`~dcp_storage_testing.gcs_server`), Azure Blob (azurite,
  :mod:`~dcp_storage_testing.azurite`);
* :mod:`~dcp_storage_testing.fault_proxy`: a reverse proxy that injects 503s,
  500s, resets, truncated bodies and slow responses in front of any of them, and
  answers ranged GETs with other bytes than asked for;
* :mod:`~dcp_storage_testing.distributed`: real multi-process gloo ranks.

Nothing in the library proper imports this package, and it imports nothing
eagerly: each helper module defers its heavy imports (boto3, torch) to first use.
"""
