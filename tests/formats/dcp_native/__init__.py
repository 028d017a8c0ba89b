"""Tests of the DCP-native record decoding."""
