"""The one thing pyproject.toml cannot say without an experimental table: the C module.

conductor._native is the ingestion hot path (the prefix hash chain, the index's per-block
loops, the ingest lane with its msgpack reader), one module built from the files of
conductor/native/ (each one concern: conductor/native/module.c lists them); any C compiler
builds it, as for every package that compiles.
"""

from pathlib import Path

from setuptools import Extension, setup

NATIVE = Path("conductor/native")

setup(
    ext_modules=[
        Extension(
            "conductor._native",
            sorted(str(path) for path in NATIVE.glob("*.c")),
            depends=sorted(str(path) for path in NATIVE.glob("*.h")),
            # the files share functions, the module exports only PyInit__native
            extra_compile_args=["-O3", "-fvisibility=hidden"],
        )
    ]
)
