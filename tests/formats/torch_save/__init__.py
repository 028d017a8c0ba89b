"""Tests of the torch.save format (archive index, safe data.pkl decoding, bad and malicious files)."""
