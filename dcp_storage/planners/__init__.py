"""Load planners: key remapping, dtype casting, strict/partial key reports, metadata from the state dict.

* :class:`RemappingLoadPlanner`: ``dcp.load(sd, storage_reader=..., planner=RemappingLoadPlanner(
  KeyMap.add_prefix("module."), strict=False))``, then ``planner.result.missing_keys``.
* :class:`DynamicMetaLoadPlanner`: drop-in for torch's (torch.save files), with the same extras.

Both are one implementation (:mod:`.planner` over the pure functions of :mod:`.matching`) composed from a
:class:`KeyMap`, a :class:`KeyRules`, a :class:`DtypePolicy` and a :class:`MetadataSource`.
"""

from dcp_storage.planners.column_plan import DtypePolicy
from dcp_storage.planners.key_map import (
    DtypeMismatchError,
    IncompatibleKeysError,
    KeyCollisionError,
    KeyMap,
    LoadResult,
    UnsupportedValueError,
    ValueTypeMismatchError,
)
from dcp_storage.planners.matching import KeyRules
from dcp_storage.planners.planner import DynamicMetaLoadPlanner, MetadataSource, RemappingLoadPlanner

__all__ = [
    "DtypeMismatchError",
    "DtypePolicy",
    "DynamicMetaLoadPlanner",
    "IncompatibleKeysError",
    "KeyCollisionError",
    "KeyMap",
    "KeyRules",
    "LoadResult",
    "MetadataSource",
    "RemappingLoadPlanner",
    "UnsupportedValueError",
    "ValueTypeMismatchError",
]
