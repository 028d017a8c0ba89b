"""The checkpoint manager: the save/restore loop of a training job over many steps (the pipeline layer).

Modules: :mod:`.folders` (one step folder: its name, whether it is complete, torn or empty, its info
file), :mod:`.steps` (the root: the index cache that makes the latest step cost O(1) requests, recovery,
commit, retention and deletion, shared with ``dcp-storage ls`` and ``gc``), :mod:`.retention`
(:class:`KeepPolicy`, whether a live save holds a folder, staging, :class:`TrainState`, the one save in
flight) and :mod:`.manager` (:class:`CheckpointManager`, the facade: the coordinator decides, every rank
gets its answer).
"""

from dcp_storage.manager.manager import CheckpointManager
from dcp_storage.manager.retention import KeepPolicy, TrainState

__all__ = ["CheckpointManager", "KeepPolicy", "TrainState"]
