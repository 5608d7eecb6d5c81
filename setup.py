"""Build the optional C extension; all other metadata lives in pyproject.toml.

``optional=True``: without a working compiler the build skips the extension
and tierstore falls back to the pure-Python key loop.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tierstore._chainhash",
            ["tierstore/_chainhash.c"],
            optional=True,
            extra_compile_args=["-O3"],
        )
    ]
)
