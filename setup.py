"""Build of the optional C extensions (everything else is in pyproject.toml).

``dcp_storage.formats.dcp_native._metadata_decode`` decodes a DCP ``.metadata`` straight into columns;
``dcp_storage.transports._pread_crc32`` reads a local byte range and CRC-32s its blocks in one native loop
(the default check of a warm local load). Both are optional: without a compiler the install still succeeds
and the pure-Python paths are used.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dcp_storage.formats.dcp_native._metadata_decode",
            sources=["dcp_storage/formats/dcp_native/_metadata_decode.c"],
            optional=True,
        ),
        Extension(
            "dcp_storage.transports._pread_crc32",
            sources=["dcp_storage/transports/_pread_crc32.c"],
            optional=True,
        ),
    ]
)
