"""A real Mooncake store (master + store process from the wheel) for ``tests/store``.

Every module here is marked ``needs("store")``: it skips, saying why, outside a network
namespace of its own or without the optional ``[store]`` extra (``tests/support/parts.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

STORE_SEGMENT_BYTES = 256 << 20


@pytest.fixture(scope="module")
def real_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from publishers.mooncake_store import LocalStore

    store = LocalStore(tmp_path_factory.mktemp("store"), STORE_SEGMENT_BYTES)
    store.start()
    yield store
    store.stop()
