"""The storage conformance suite a backend or a transport plugin runs: see :mod:`.mixin`.

Modelled on fsspec's ``fsspec/tests/abstract``: subclass :class:`StorageConformance` in a test module and
provide ``location`` (and ``shared_location``) fixtures, each a plain ``(url, storage_options)`` pair or a
:class:`Location`; every test then runs on that backend. The fixtures are documented in :mod:`.mixin`.
"""

from dcp_storage_testing.conformance.helpers import (
    Location,
    as_location,
    assert_state_equal,
    child,
    counted_since,
    dcp_state_dict,
    destination_like,
    fsspec_knows,
    fsspec_options,
    random_bits,
    random_bytes,
    safetensors_state_dict,
    shown_url,
    stored,
    tensor_bytes,
    unwrap,
)
from dcp_storage_testing.conformance.mixin import RANKS_TIMEOUT_S, TEST_CONFIG, StorageConformance

__all__ = [
    "RANKS_TIMEOUT_S",
    "TEST_CONFIG",
    "Location",
    "StorageConformance",
    "as_location",
    "assert_state_equal",
    "child",
    "counted_since",
    "dcp_state_dict",
    "destination_like",
    "fsspec_knows",
    "fsspec_options",
    "random_bits",
    "random_bytes",
    "safetensors_state_dict",
    "shown_url",
    "stored",
    "tensor_bytes",
    "unwrap",
]
