"""The safetensors format: single files, directories, HF sharded indexes, torch DCP-safetensors layouts."""
