"""The package version, defined once: ``dcp_storage.__version__``, the CLI's ``--version`` and the writer
descriptor recorded in checkpoints (:mod:`dcp_storage.integrity.manifest`) all read it from here, so
none of them imports the package ``__init__``."""

__version__ = "0.1.0"
