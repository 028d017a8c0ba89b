"""DCP's native layout: ``.metadata`` plus ``*.distcp`` files of ``torch.save`` records."""

from dcp_storage.formats.dcp_native.native import METADATA_FILE, dump_metadata, load_metadata, metadata_allow_list
from dcp_storage.formats.dcp_native.torch_record import TensorRecord, parse_tensor_record

__all__ = [
    "METADATA_FILE",
    "TensorRecord",
    "dump_metadata",
    "load_metadata",
    "metadata_allow_list",
    "parse_tensor_record",
]
