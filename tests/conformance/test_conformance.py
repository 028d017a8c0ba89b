"""The storage conformance suite on every backend (see :mod:`.mixin` for the tests, ``conftest.py`` for the
backends: local, ``file://``, ``memory://``, ``s3://``, ``gs://``, ``az://``)."""

from __future__ import annotations

import pytest

from dcp_storage_testing.conformance import StorageConformance

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class TestStorageConformance(StorageConformance):
    """Collected once; the parametrised ``location`` fixture runs every test on every backend."""
