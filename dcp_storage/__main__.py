"""``python -m dcp_storage ...`` runs the ``dcp-storage`` command line."""

import sys

from .cli import main

sys.exit(main())
