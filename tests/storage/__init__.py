"""Storage reader/writer tests (a package, so that ``_rank_fns`` is importable by rank processes and
test module names cannot clash with same-named files in other test directories)."""
