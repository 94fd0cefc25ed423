"""The one thing pyproject.toml cannot say without an experimental table: the C module.

conductor/_native.c is the ingestion hot path (the prefix hash chain, the index's per-block
loops, the ingest lane with its msgpack reader in conductor/_msgpack.h); any C compiler
builds it, as for every package that compiles.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "conductor._native",
            ["conductor/_native.c"],
            depends=["conductor/_msgpack.h"],
            extra_compile_args=["-O3"],
        )
    ]
)
