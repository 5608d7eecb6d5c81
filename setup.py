"""Build the optional C extensions; all other metadata lives in pyproject.toml.

``optional=True``: without a working compiler the build skips an extension
and tierstore falls back to Python (the key loop over blake3-py; numpy's
memcpy for block copies).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tierstore._chainhash",
            ["tierstore/_chainhash.c"],
            optional=True,
            extra_compile_args=["-O3"],
        ),
        Extension(
            "tierstore.memory._fastcopy",
            ["tierstore/memory/_fastcopy.c"],
            optional=True,
            extra_compile_args=["-O3"],
        ),
    ]
)
