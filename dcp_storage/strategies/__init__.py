"""Strategies: who touches storage.

* :class:`Broadcasting` - wrap any ``StorageReader`` so that only the coordinator reads and every other
  rank receives exactly the slices of its plan over the process group.
* :func:`share_object` - run a function on one rank, give its result or its error to all (what every
  reader calls in ``read_metadata``: the one coordinator broadcast).
* :class:`ReadStrategies` - named factories of read strategies (``per_rank``, ``read_once``, ``per_host``):
  which rank fetches the stored bytes that several ranks need (:mod:`.read_strategy`).
* :mod:`.coordinator_served` - "the coordinator reads and sends", the one mechanism :class:`Broadcasting` and
  :class:`~dcp_storage.BroadcastingTorchSaveReader` are (they differ only in how the coordinator reads), on
  the send/receive protocol of :mod:`.slice_delivery`, whose destination check ``read_once`` shares.
* :class:`~.read_strategy.StrategyReading` - the read-strategy wiring every format's reader composes.
* :mod:`.collectives` - where a rank stands in its process group, and the one rule for the device the
  group's collectives use.
"""

from dcp_storage.strategies.broadcasting import Broadcasting
from dcp_storage.strategies.collectives import share_object
from dcp_storage.strategies.prefixes import (
    BinaryPrefixStrategy,
    DecimalPrefixStrategy,
    HexPrefixStrategy,
    PrefixStrategy,
    RoundRobinPrefixStrategy,
)
from dcp_storage.strategies.read_once_plan import ReadOnceConfig
from dcp_storage.strategies.read_strategy import ReadStrategies, ReadStrategy
from dcp_storage.strategies.slice_delivery import DeliveryConfig, DeliveryStats

__all__ = [
    "BinaryPrefixStrategy",
    "DecimalPrefixStrategy",
    "HexPrefixStrategy",
    "PrefixStrategy",
    "RoundRobinPrefixStrategy",
    "Broadcasting",
    "DeliveryConfig",
    "DeliveryStats",
    "ReadOnceConfig",
    "ReadStrategies",
    "ReadStrategy",
    "share_object",
]
