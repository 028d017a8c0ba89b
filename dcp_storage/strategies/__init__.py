"""Strategies: who touches storage.

* :class:`Broadcasting` - wrap any ``StorageReader`` so that only the coordinator reads and every other
  rank receives exactly the slices of its plan over the process group.
* :func:`share_object` - run a function on one rank, give its result or its error to all (what readers
  call in ``read_metadata``).
* :class:`ReadStrategies` - named factories of read strategies (``per_rank``, ``read_once``, ``per_host``):
  which rank fetches the stored bytes that several ranks need (:mod:`.read_strategy`).
* :mod:`.slice_delivery` - the send/receive protocol both of the above, and
  :class:`~dcp_storage.BroadcastingTorchSaveReader`, are built on.
"""

from .broadcasting import Broadcasting
from .metadata_sharing import share_object
from .read_strategy import ReadStrategies, ReadStrategy
from .slice_delivery import DeliveryConfig, DeliveryStats

__all__ = ["Broadcasting", "DeliveryConfig", "DeliveryStats", "ReadStrategies", "ReadStrategy", "share_object"]
