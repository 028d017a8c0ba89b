"""The ``torch.save`` file format: a zip archive indexed by ranged reads, ``data.pkl`` decoded safely.

* :mod:`.zip_index` - the archive's records from its central directory (no record is read);
* :mod:`.pickle_tree` - ``data.pkl`` through an allow-list, tensors as descriptors (no storage is read);
* :mod:`.archive` - both together: DCP ``Metadata`` and where each tensor's elements lie;
* :mod:`.describe`, :mod:`.verify`, :mod:`.convert_out` - what ``inspect``, ``verify`` and ``convert`` do
  with such a file (the hooks of :data:`.spec.FORMAT`).
"""

from dcp_storage.formats.torch_save.archive import (
    TorchSaveArchive,
    TorchSaveArchiveConfig,
    UnsupportedFormatError,
    flatten_tree,
)
from dcp_storage.formats.torch_save.pickle_tree import TensorDescriptor, decode_data_pkl

__all__ = [
    "TorchSaveArchiveConfig",
    "TensorDescriptor",
    "TorchSaveArchive",
    "UnsupportedFormatError",
    "decode_data_pkl",
    "flatten_tree",
]
