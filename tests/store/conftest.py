"""A real Mooncake store (master + store process from the wheel) for ``tests/store``.

The Mooncake binaries listen on every interface whatever their flags say (the metadata
server and the transfer engine's ports), so these tests run only in a network namespace of
their own (``scripts/isolated-net.sh``, which ``.ci/run`` runs the whole suite in).
Elsewhere they skip with that reason, and without the optional ``[store]`` extra too.
"""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from publishers.local import free_port

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


def _wait_listening(port: int, process: subprocess.Popen, log: Path, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text(errors="replace")[-2000:]
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {port}:\n{log.read_text(errors='replace')[-2000:]}")


class RealStore:
    """``mooncake_master`` and one store process holding the memory, on 127.0.0.1."""

    def __init__(self, run_dir: Path) -> None:
        from publishers.store import StoreAddress

        self.run_dir = run_dir
        self.rpc_port, self.metadata_port = free_port(), free_port()
        self.metrics_port, self.store_port = free_port(), free_port()
        self.address = StoreAddress(
            f"127.0.0.1:{self.rpc_port}", f"http://127.0.0.1:{self.metadata_port}/metadata"
        )
        self.master: subprocess.Popen | None = None
        self.store: subprocess.Popen | None = None

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen:
        log = self.run_dir / f"{name}.log"
        with log.open("ab") as output:
            return subprocess.Popen(
                command, stdout=output, stderr=subprocess.STDOUT, cwd=self.run_dir
            )

    def start(self) -> None:
        from publishers.store import master_command, store_process_command

        self.master = self._spawn(
            "master", master_command(self.rpc_port, self.metadata_port, self.metrics_port)
        )
        _wait_listening(self.rpc_port, self.master, self.run_dir / "master.log")
        _wait_listening(self.metadata_port, self.master, self.run_dir / "master.log")
        self.store = self._spawn(
            "store", store_process_command(self.address, self.store_port, STORE_SEGMENT_BYTES)
        )
        _wait_listening(self.store_port, self.store, self.run_dir / "store.log")
        time.sleep(0.5)  # the segment is mounted right after the port opens

    def stop(self) -> None:
        for process in (self.store, self.master):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(5)


@pytest.fixture(scope="module")
def real_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealStore]:
    store = RealStore(tmp_path_factory.mktemp("store"))
    store.start()
    yield store
    store.stop()
