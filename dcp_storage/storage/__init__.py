"""DCP ``StorageReader``/``StorageWriter`` classes: thin compositions of transport, format and strategy."""

from .fsspec_reader import FsspecReader
from .fsspec_writer import FsspecWriter
from .prefixes import (
    BinaryPrefixStrategy,
    DecimalPrefixStrategy,
    HexPrefixStrategy,
    PrefixStrategy,
    RoundRobinPrefixStrategy,
)
from .safetensors_reader import SafetensorsReader
from .safetensors_writer import SafetensorsWriter
from .torch_save_reader import BroadcastingTorchSaveReader

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
