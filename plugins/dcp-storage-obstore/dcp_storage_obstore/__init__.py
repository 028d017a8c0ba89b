"""dcp-storage transport on obstore (the Rust ``object_store`` client), for ``s3://`` URLs.

Registered under the ``dcp_storage.transports`` entry-point group as ``obstore``; select it with
``storage_options={"transport": "obstore", ...}`` (the rest of the options are the s3fs-style ones).
"""

from dcp_storage_obstore.options import ObstoreOptionsError, S3Settings, s3_settings
from dcp_storage_obstore.transport import ObstoreTransport

__all__ = ["ObstoreOptionsError", "ObstoreTransport", "S3Settings", "s3_settings"]
__version__ = "0.1.0"
