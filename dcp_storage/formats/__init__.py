"""Formats turn a checkpoint layout into DCP Metadata plus byte ranges, and bytes into tensors."""
