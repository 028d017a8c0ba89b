"""``python -m dcp_storage ...`` runs the ``dcp-storage`` command line."""

import sys

from dcp_storage.cli import main

sys.exit(main())
