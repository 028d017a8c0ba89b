"""The core's storage conformance suite (:mod:`dcp_storage_testing.conformance`) on the obstore transport.

Every test of :class:`StorageConformance` runs against moto through ``{"transport": "obstore"}``: the
same contract the core's own backends keep, checked by the same tests.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from dcp_storage_testing.conformance import Location, StorageConformance
from dcp_storage_testing.s3_server import S3Location

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _obstore(location: S3Location) -> Location:
    return Location(location.url, {**location.storage_options, "transport": "obstore"}, "s3")


class TestObstoreConformance(StorageConformance):
    @pytest.fixture
    def location(self, s3_url: S3Location) -> Iterator[Location]:
        yield _obstore(s3_url)

    @pytest.fixture
    def shared_location(self, s3_url: S3Location) -> Iterator[Location]:
        yield _obstore(s3_url)
