"""Property-based fuzzing of the parsers that read untrusted bytes (see tests/README.md for the long run)."""
