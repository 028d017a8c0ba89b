"""Tests of the coordinator-reads strategies (a package so rank functions import by module name)."""
