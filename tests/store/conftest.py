"""A real Mooncake store (master + store process from the wheel) for ``tests/store``.

The Mooncake binaries listen on every interface whatever their flags say (the metadata
server and the transfer engine's ports), so these tests run only in a network namespace of
their own (``scripts/isolated-net.sh``, which ``.ci/run`` runs the whole suite in).
Elsewhere they skip with that reason, and without the optional ``[store]`` extra too.
"""

from __future__ import annotations

import importlib.util
import socket
from collections.abc import Iterator
from typing import Any

import pytest

STORE_SEGMENT_BYTES = 256 << 20
ISOLATED_INTERFACES = {"lo", "lan0", "lan1"}  # what scripts/isolated-net.sh creates


def _skip_reason() -> str | None:
    if importlib.util.find_spec("mooncake") is None or importlib.util.find_spec("torch") is None:
        return "the Mooncake store wheel and torch are not installed (pip install -e '.[store]')"
    interfaces = {name for _, name in socket.if_nameindex()}
    if not interfaces <= ISOLATED_INTERFACES:
        return (
            "the Mooncake binaries listen on every interface: run the suite in a network "
            "namespace of its own (scripts/isolated-net.sh python -m pytest)"
        )
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _skip_reason()
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
