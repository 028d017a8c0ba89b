"""The checkpoint manager: the save/restore loop of a training job over many steps (the pipeline layer).

One module per job: :mod:`.layout` (step folder names), :mod:`.listing` (which steps are complete, from
their commit markers), :mod:`.index` (the small cache that makes the latest step cost O(1) requests),
:mod:`.liveness` (whether a live save holds a folder), :mod:`.retention` (:class:`KeepPolicy`),
:mod:`.cleanup` (deleting steps and torn folders, shared with ``dcp-storage gc``), :mod:`.staging`
(copying the state off the training loop's tensors), :mod:`.saving` (the one save in flight),
:mod:`.agreement` (the coordinator decides, every rank gets its answer), :mod:`.train_state`
(:class:`TrainState`) and :mod:`.manager` (:class:`CheckpointManager`, the facade).
"""

from dcp_storage.manager.manager import CheckpointManager
from dcp_storage.manager.retention import KeepPolicy, TrainState

__all__ = ["CheckpointManager", "KeepPolicy", "TrainState"]
