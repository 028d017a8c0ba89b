"""Build of the optional C extension (everything else is in pyproject.toml).

``dcp_storage.formats.dcp_native._metadata_decode`` decodes a DCP ``.metadata`` straight into columns. It
is optional: without a compiler the install still succeeds and the pure-Python general path is used.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "dcp_storage.formats.dcp_native._metadata_decode",
            sources=["dcp_storage/formats/dcp_native/_metadata_decode.c"],
            optional=True,
        )
    ]
)
