"""A real Mooncake store (master + store process from the wheel) for ``tests/store``.

The tests skip, saying why, outside a network namespace of their own or without the optional
``[store]`` extra (``tests/support/store.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.store import store_skip_reason

STORE_SEGMENT_BYTES = 256 << 20


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = store_skip_reason()
    if reason is None:
        return
    for item in items:
        if "tests/store/" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="module")
def real_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from publishers.store import LocalStore

    store = LocalStore(tmp_path_factory.mktemp("store"), STORE_SEGMENT_BYTES)
    store.start()
    yield store
    store.stop()
