"""The safetensors format: single files, directories, HF sharded indexes, torch DCP-safetensors layouts."""

from dcp_storage.formats.safetensors.loader import SafetensorsLoaderConfig, SafetensorsScanConfig

__all__ = ["SafetensorsLoaderConfig", "SafetensorsScanConfig"]
