"""DCP ``StorageReader``/``StorageWriter`` classes: thin compositions of transport, format and strategy."""

from .fsspec_reader import FsspecReader
from .fsspec_writer import FsspecWriter

__all__ = ["FsspecReader", "FsspecWriter"]
