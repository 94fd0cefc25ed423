"""When the real Mooncake store can run here, and why not.

The store's binaries listen on every interface whatever their flags say, and refuse to
start without a non-loopback address, so tests that start them run only in a network
namespace of their own, as ``scripts/isolated-net.sh`` makes (``.ci/run`` runs the whole
suite in one).
"""

from __future__ import annotations

import importlib.util
import socket

ISOLATED_INTERFACES = {"lo", "lan0", "lan1"}  # what scripts/isolated-net.sh creates


def store_skip_reason() -> str | None:
    if importlib.util.find_spec("mooncake") is None or importlib.util.find_spec("torch") is None:
        return "the Mooncake store wheel and torch are not installed (pip install -e '.[store]')"
    if not {name for _, name in socket.if_nameindex()} <= ISOLATED_INTERFACES:
        return (
            "the Mooncake binaries listen on every interface: run the suite in a network "
            "namespace of its own (scripts/isolated-net.sh python -m pytest)"
        )
    return None
