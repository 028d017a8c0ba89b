"""Safetensors format tests (a package, so that rank functions are importable by rank processes)."""
