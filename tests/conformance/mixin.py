"""Moved: the conformance mixin ships as :mod:`dcp_storage_testing.conformance` (plugins run it too).

Kept so that ``from .mixin import ...`` in this directory's suites keeps working.
"""

from dcp_storage_testing.conformance import *
from dcp_storage_testing.conformance import __all__  # noqa: F401
