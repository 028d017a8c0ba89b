"""Format tests."""
