"""DCP ``StorageReader``/``StorageWriter`` classes: thin compositions of transport, format and strategy."""

from dcp_storage.storage.fsspec_reader import FsspecReader
from dcp_storage.storage.fsspec_writer import FsspecWriter
from dcp_storage.storage.prefixes import (
    BinaryPrefixStrategy,
    DecimalPrefixStrategy,
    HexPrefixStrategy,
    PrefixStrategy,
    RoundRobinPrefixStrategy,
)
from dcp_storage.storage.safetensors_reader import SafetensorsReader
from dcp_storage.storage.safetensors_writer import SafetensorsWriter
from dcp_storage.storage.torch_save_reader import BroadcastingTorchSaveReader

__all__ = [
    "BinaryPrefixStrategy",
    "BroadcastingTorchSaveReader",
    "DecimalPrefixStrategy",
    "FsspecReader",
    "FsspecWriter",
    "HexPrefixStrategy",
    "PrefixStrategy",
    "RoundRobinPrefixStrategy",
    "SafetensorsReader",
    "SafetensorsWriter",
]
