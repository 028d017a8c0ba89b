"""DCP ``StorageReader``/``StorageWriter`` classes: thin compositions of transport, format and strategy."""

from .fsspec_reader import FsspecReader
from .fsspec_writer import FsspecWriter
from .safetensors_reader import SafetensorsReader
from .safetensors_writer import SafetensorsWriter
from .torch_save_reader import BroadcastingTorchSaveReader

__all__ = ["BroadcastingTorchSaveReader", "FsspecReader", "FsspecWriter", "SafetensorsReader", "SafetensorsWriter"]
